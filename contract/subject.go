package contract

import "strings"

// NATS subject filters: '*' matches one token, '>' one or more trailing
// tokens. These are the only implementations in the project; the router,
// the publisher, the configuration and the tools all call them, so a
// change of the subject layout cannot leave a private copy behind.

// SubjectMatches reports whether the literal subject matches one of the
// filters.
func SubjectMatches(subject string, filters ...string) bool {
	for _, f := range filters {
		if FilterCovers(f, subject) {
			return true
		}
	}
	return false
}

// FilterCovers reports whether every subject matching inner also matches
// outer (both may hold wildcards; a literal inner is a plain match).
func FilterCovers(outer, inner string) bool {
	ot, it := strings.Split(outer, "."), strings.Split(inner, ".")
	for i := 0; ; i++ {
		switch {
		case i == len(ot):
			return i == len(it)
		case ot[i] == ">":
			return i < len(it)
		case i == len(it):
			return false
		case it[i] == ">":
			return false
		case ot[i] == "*":
		case it[i] == "*":
			return false
		case ot[i] != it[i]:
			return false
		}
	}
}

// FiltersOverlap reports whether some subject matches both filters.
func FiltersOverlap(a, b string) bool {
	at, bt := strings.Split(a, "."), strings.Split(b, ".")
	for i := 0; ; i++ {
		switch {
		case i == len(at) || i == len(bt):
			return len(at) == len(bt)
		case at[i] == ">" || bt[i] == ">":
			return true
		case at[i] != "*" && bt[i] != "*" && at[i] != bt[i]:
			return false
		}
	}
}
