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
		if p.byte('.') {
			n := 0
			for p.i < len(b) && b[p.i] >= '0' && b[p.i] <= '9' {
				if n < 9 {
					nsec = nsec*10 + int(b[p.i]-'0')
				} else if n == 9 {
					// PostgreSQL keeps microseconds; more digits than
					// nanoseconds would be a different writer's text.
					return time.Time{}, errTimestamp
				}
				n++
				p.i++
			}
			if n == 0 {
				return time.Time{}, errTimestamp
			}
			for ; n < 9; n++ {
				nsec *= 10
			}
		}
		if p.i < len(b) {
			switch b[p.i] {
			case 'Z':
				p.i++
			case '+', '-':
				sign := 1
				if b[p.i] == '-' {
					sign = -1
				}
				p.i++
				oh := p.digits(2)
				var om, os int
				if p.byte(':') {
					om = p.digits(2)
					if p.byte(':') {
						os = p.digits(2)
					}
				}
				if oh > 15 || om > 59 || os > 59 {
					return time.Time{}, errTimestamp
				}
				offset = sign * (oh*3600 + om*60 + os)
			}
		}
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
