package router

import (
	"fmt"
	"strings"
)

// DefaultSubject is the subject template of a table that names none.
const DefaultSubject = "outbox.{aggregate_type}.{aggregate_id}"

// placeholder identifies a value a subject template can substitute.
type placeholder uint8

const (
	phNone placeholder = iota
	phAggregateType
	phAggregateID
	phEventType
	phTable
	phSchema
	numPlaceholders
)

var placeholderNames = [numPlaceholders]string{
	phAggregateType: "aggregate_type",
	phAggregateID:   "aggregate_id",
	phEventType:     "event_type",
	phTable:         "table",
	phSchema:        "schema",
}

const placeholderHint = "use {aggregate_type}, {aggregate_id}, {event_type}, {table}, {schema}"

func lookupPlaceholder(name string) placeholder {
	for p := phAggregateType; p < numPlaceholders; p++ {
		if placeholderNames[p] == name {
			return p
		}
	}
	return phNone
}

// segment is a run of literal text or one placeholder.
type segment struct {
	lit string
	ph  placeholder // phNone for literal text
}

// template is a parsed subject template.
type template struct {
	segs []segment
	// litLen is the number of literal bytes, the subject's length before
	// substitution.
	litLen int
	// filter is the subject filter matching every subject the template can
	// produce: each token holding a placeholder becomes '*'.
	filter string
}

// templateError is a parse error; Validate turns it into a ConfigError
// naming the YAML key.
type templateError struct{ msg string }

func (e *templateError) Error() string { return e.msg }

func tmplErrorf(format string, args ...any) error {
	return &templateError{msg: fmt.Sprintf(format, args...)}
}

// parseTemplate parses a subject template such as
// "outbox.{aggregate_type}.{aggregate_id}". Placeholders may sit anywhere
// inside a token ("evt-{event_type}"); every substituted value is escaped
// with EscapeToken, so only the literal text decides the token structure,
// and that is what parseTemplate checks: no empty tokens, no wildcards, no
// whitespace, balanced braces, known placeholders, and two placeholders in
// one token only with a separator no escaped value contains, so that
// distinct values never render one subject.
func parseTemplate(s string) (*template, error) {
	if s == "" {
		return nil, tmplErrorf("is empty (the default is %q)", DefaultSubject)
	}
	p := &tmplParser{t: &template{}, prevPh: phNone}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '{':
			end, err := p.placeholder(s, i)
			if err != nil {
				return nil, err
			}
			i = end
		case c == '}':
			return nil, tmplErrorf("unbalanced braces: '}' at offset %d has no '{' (%s)", i, placeholderHint)
		case c == '*' || c == '>':
			return nil, tmplErrorf("wildcard %q in a literal token: subjects published to must be literal (placeholders become wildcards only in subject filters)", c)
		case c <= ' ' || c == 0x7F:
			return nil, tmplErrorf("whitespace or control byte %q at offset %d: NATS subjects cannot contain it", c, i)
		default:
			switch {
			case c == '.':
				p.prevPh = phNone
			case !safeByte[c] && c != '~':
				p.apart = true
			}
			p.lit.WriteByte(c)
		}
	}
	p.flushLit()
	filter, err := subjectFilter(s)
	if err != nil {
		return nil, err
	}
	p.t.filter = filter
	return p.t, nil
}

// tmplParser is parseTemplate's state.
type tmplParser struct {
	t   *template
	lit strings.Builder // literal text since the last placeholder
	// Two placeholders may share a token only with a byte between them that
	// no escaped value contains (escaped values are made of [A-Za-z0-9_-]
	// and '~'): "{aggregate_type}-{aggregate_id}" would give types "a-b"
	// and "a" with ids "c" and "b-c" one subject, "{aggregate_type}:{aggregate_id}"
	// cannot. prevPh is the placeholder earlier in the current token, and
	// apart tells whether such a byte follows it.
	prevPh placeholder
	apart  bool
}

// flushLit ends the literal segment in progress, if any.
func (p *tmplParser) flushLit() {
	if p.lit.Len() > 0 {
		p.t.segs = append(p.t.segs, segment{lit: p.lit.String()})
		p.t.litLen += p.lit.Len()
		p.lit.Reset()
	}
}

// placeholder parses the placeholder whose '{' is at s[i] and returns the
// offset of its '}'.
func (p *tmplParser) placeholder(s string, i int) (int, error) {
	end := strings.IndexAny(s[i+1:], "{}")
	if end < 0 || s[i+1+end] == '{' {
		return 0, tmplErrorf("unbalanced braces: '{' at offset %d is not closed (%s)", i, placeholderHint)
	}
	name := s[i+1 : i+1+end]
	if name == "" {
		return 0, tmplErrorf("empty placeholder {} at offset %d (%s)", i, placeholderHint)
	}
	ph := lookupPlaceholder(name)
	if ph == phNone {
		return 0, tmplErrorf("unknown placeholder {%s} (%s)", name, placeholderHint)
	}
	segs := p.t.segs
	if p.lit.Len() == 0 && len(segs) > 0 && segs[len(segs)-1].ph != phNone {
		// "{aggregate_type}{aggregate_id}" would make "ab"+"c" and
		// "a"+"bc" the same subject.
		prev := segs[len(segs)-1].phName()
		return 0, tmplErrorf("placeholders {%s} and {%s} touch: put a separator between them, e.g. {%s}.{%s}", prev, name, prev, name)
	}
	if p.prevPh != phNone && !p.apart {
		prev := placeholderNames[p.prevPh]
		return 0, tmplErrorf("placeholders {%s} and {%s} share a token with only letters, digits, '_', '-' or '~' between them, which values contain too: two aggregates could get one subject; "+
			"separate them with a byte such as ':' or '+' ({%s}:{%s}), or put each in a token of its own ({%s}.{%s})",
			prev, name, prev, name, prev, name)
	}
	p.prevPh, p.apart = ph, false
	p.flushLit()
	p.t.segs = append(p.t.segs, segment{ph: ph})
	return i + end + 1, nil
}

// subjectFilter checks the template's tokens and returns the subject
// filter that matches every subject it renders: each token holding a
// placeholder becomes '*'.
func subjectFilter(s string) (string, error) {
	tokens := strings.Split(s, ".")
	for i, tok := range tokens {
		if tok != "" {
			continue
		}
		switch i {
		case 0, len(tokens) - 1:
			return "", tmplErrorf("must not start or end with '.' (a subject has no empty tokens)")
		default:
			return "", tmplErrorf("has an empty token (two dots in a row)")
		}
	}
	if strings.HasPrefix(s, "$") {
		return "", tmplErrorf("starts with '$': subjects beginning with '$' are reserved for NATS system APIs ($JS, $SYS, ...)")
	}
	for i, tok := range tokens {
		if strings.IndexByte(tok, '{') >= 0 {
			tokens[i] = "*"
		}
	}
	return strings.Join(tokens, "."), nil
}

func (s segment) phName() string { return placeholderNames[s.ph] }

// render appends the subject for the placeholder values vals to dst,
// escaping each value.
func (t *template) render(dst []byte, vals *[numPlaceholders][]byte) []byte {
	for _, sg := range t.segs {
		if sg.ph == phNone {
			dst = append(dst, sg.lit...)
			continue
		}
		dst = appendEscaped(dst, vals[sg.ph])
	}
	return dst
}

// renderedLen returns len(render(nil, vals)) without building it.
func (t *template) renderedLen(vals *[numPlaceholders][]byte) int {
	n := t.litLen
	for _, sg := range t.segs {
		if sg.ph != phNone {
			n += escapedLen(vals[sg.ph])
		}
	}
	return n
}

// EventPlaceholders returns the placeholders of the table's subject
// template (DefaultSubject when empty) whose value can differ between the
// events of one aggregate: {event_type}. A partitioned stream hashes the
// subject's wildcard tokens, so such a token spreads one aggregate over
// partitions and its order is lost for consumer groups. A template that
// does not parse returns nil (Validate reports it).
func (t TableConfig) EventPlaceholders() []string { return eventPlaceholders(t.Subject) }

// EventPlaceholders is TableConfig.EventPlaceholders for a message prefix's
// subject template.
func (m MessageConfig) EventPlaceholders() []string { return eventPlaceholders(m.Subject) }

func eventPlaceholders(s string) []string {
	if s == "" {
		s = DefaultSubject
	}
	tp, err := parseTemplate(s)
	if err != nil {
		return nil
	}
	var out []string
	for _, seg := range tp.segs {
		switch seg.ph {
		case phNone, phAggregateType, phAggregateID, phTable, phSchema:
			// Constant for one aggregate: its type and id, and the
			// table it is written to.
		default:
			out = append(out, "{"+placeholderNames[seg.ph]+"}")
		}
	}
	return out
}
