package router

import (
	"errors"
	"time"
)

// errTimestamp explains what parseTimestamp accepts; Route puts it in the
// RouteError reason.
var errTimestamp = errors.New("is not a timestamp in PostgreSQL's ISO output (e.g. 2026-11-29 09:35:21.123456+00)")

// parseTimestamp parses the text output of timestamptz and timestamp under
// DateStyle=ISO: "2026-11-29 09:35:21.123456+00", with an offset of the form
// +HH, +HH:MM or +HH:MM:SS (historical local mean time offsets have
// seconds), or none for a timestamp without time zone, which is taken as
// UTC. It also accepts a 'T' separator, a 'Z' offset and a bare date, so a
// text column holding RFC 3339 works too. Infinity, BC dates and years past
// 9999 are refused: RFC 3339 cannot express them. It does not allocate.
func parseTimestamp(b []byte) (time.Time, error) {
	p := tsParser{b: b}
	year := p.digits(4)
	if !p.byte('-') {
		return time.Time{}, errTimestamp
	}
	month := p.digits(2)
	if !p.byte('-') {
		return time.Time{}, errTimestamp
	}
	day := p.digits(2)
	var hour, minute, sec, nsec, offset int
	if p.i < len(b) {
		if !p.byte(' ') && !p.byte('T') {
			return time.Time{}, errTimestamp
		}
		hour = p.digits(2)
		if !p.byte(':') {
			return time.Time{}, errTimestamp
		}
		minute = p.digits(2)
		if !p.byte(':') {
			return time.Time{}, errTimestamp
		}
		sec = p.digits(2)
		nsec = p.fraction()
		offset = p.offset()
	}
	if p.bad || p.i != len(b) ||
		year < 1 || month < 1 || month > 12 || day < 1 || day > daysIn(month, year) ||
		hour > 23 || minute > 59 || sec > 59 {
		return time.Time{}, errTimestamp
	}
	t := time.Date(year, time.Month(month), day, hour, minute, sec, nsec, time.UTC)
	t = t.Add(-time.Duration(offset) * time.Second)
	if y := t.Year(); y < 1 || y > 9999 {
		// The offset moved it out of the range RFC 3339 can express.
		return time.Time{}, errTimestamp
	}
	return t, nil
}

type tsParser struct {
	b   []byte
	i   int
	bad bool
}

// fraction reads an optional fraction of a second ('.' and 1 to 9
// digits) as nanoseconds.
func (p *tsParser) fraction() (nsec int) {
	if !p.byte('.') {
		return 0
	}
	n := 0
	for p.i < len(p.b) && p.b[p.i] >= '0' && p.b[p.i] <= '9' {
		if n == 9 {
			// PostgreSQL keeps microseconds; more digits than
			// nanoseconds would be a different writer's text.
			p.bad = true
			return 0
		}
		nsec = nsec*10 + int(p.b[p.i]-'0')
		n++
		p.i++
	}
	if n == 0 {
		p.bad = true
	}
	for ; n < 9; n++ {
		nsec *= 10
	}
	return nsec
}

// offset reads an optional UTC offset, 'Z' or +HH[:MM[:SS]], in seconds
// east of UTC.
func (p *tsParser) offset() int {
	if p.byte('Z') || p.i >= len(p.b) {
		return 0
	}
	sign := 1
	switch {
	case p.byte('-'):
		sign = -1
	case !p.byte('+'):
		return 0 // not an offset: the caller finds the bytes left over
	}
	oh := p.digits(2)
	var om, os int
	if p.byte(':') {
		om = p.digits(2)
		if p.byte(':') {
			os = p.digits(2)
		}
	}
	if oh > 15 || om > 59 || os > 59 {
		p.bad = true
	}
	return sign * (oh*3600 + om*60 + os)
}

// digits reads exactly n decimal digits; a shortfall marks the parse bad.
func (p *tsParser) digits(n int) int {
	v := 0
	for k := 0; k < n; k++ {
		if p.i >= len(p.b) || p.b[p.i] < '0' || p.b[p.i] > '9' {
			p.bad = true
			return 0
		}
		v = v*10 + int(p.b[p.i]-'0')
		p.i++
	}
	return v
}

// byte consumes c if it is next.
func (p *tsParser) byte(c byte) bool {
	if p.i < len(p.b) && p.b[p.i] == c {
		p.i++
		return true
	}
	return false
}

func daysIn(month, year int) int {
	switch month {
	case 2:
		if year%4 == 0 && (year%100 != 0 || year%400 == 0) {
			return 29
		}
		return 28
	case 4, 6, 9, 11:
		return 30
	}
	return 31
}
