package grouptest

import (
	"bufio"
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/internal/relaytest"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// waitEvery is testenv.WaitFor polling every interval: a condition that
// asks the NATS server for consumer infos must not itself load the server
// it measures (16 requests every 20 ms on a starved race-built server).
func waitEvery(timeout, interval time.Duration, cond func() bool) bool {
	var last time.Time
	return testenv.WaitFor(timeout, func() bool {
		if time.Since(last) < interval {
			return false
		}
		last = time.Now()
		return cond()
	})
}

// consumedSince reports whether each partition of ps (of partitions) has
// had an event applied by a member other than gone since t: the partition
// is consumed again, whatever its pin shows. It returns the store time of
// the event that came last of those first applications (a partition can
// be applied only once an event is there).
func (s *scenario) consumedSince(ps []int, partitions int, gone string, t time.Time) (stored time.Time, ok bool) {
	s.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	rows, err := s.f.DB.Pool.Query(ctx, `SELECT DISTINCT ON (subject) subject, at, stored FROM applied WHERE member <> $1 AND at > $2 ORDER BY subject, at`, gone, t)
	if err != nil {
		return time.Time{}, false
	}
	defer rows.Close()
	type first struct{ at, stored time.Time }
	seen := map[int]first{}
	source := s.f.Prefix + ".*.*"
	for rows.Next() {
		var subject string
		var f first
		if rows.Scan(&subject, &f.at, &f.stored) != nil {
			return time.Time{}, false
		}
		if n, p, ok := contract.SubjectPartition(source, subject); ok && n == partitions {
			if have, ok := seen[p]; !ok || f.at.Before(have.at) {
				seen[p] = f
			}
		}
	}
	var last first
	for _, p := range ps {
		f, ok := seen[p]
		if !ok {
			return time.Time{}, false
		}
		if f.at.After(last.at) {
			last = f
		}
	}
	return last.stored, rows.Err() == nil
}

// arrived describes when the event that ended a takeover measurement was
// stored, relative to the signal: a figure whose last event arrived after
// the signal is bounded by the load, not by the takeover.
func arrived(stored, signal time.Time) string {
	if d := stored.Sub(signal); d > 0 {
		return fmt.Sprintf("its event stored %.1fs after the signal", d.Seconds())
	}
	return "a backlog"
}

// reassignedAt is when the first live member logged an assignment whose
// members no longer include gone, after t (zero when none did): the
// roster's part of a takeover, apart from the server's.
func (s *scenario) reassignedAt(gone string, t time.Time) time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	var first time.Time
	for id, m := range s.members {
		if id == gone {
			continue
		}
		m.mu.Lock()
		out := m.out.String()
		m.mu.Unlock()
		sc := bufio.NewScanner(strings.NewReader(out))
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			_, rest, ok := strings.Cut(line, `"members": [`)
			if !ok || !strings.Contains(line, "partition assignment") {
				continue
			}
			at, err := time.Parse("2006-01-02T15:04:05.000Z0700", strings.Fields(line)[0])
			if err != nil || !at.After(t) {
				continue
			}
			list, _, _ := strings.Cut(rest, "]")
			if !slices.Contains(strings.Split(strings.ReplaceAll(list, `"`, ""), ", "), gone) && (first.IsZero() || at.Before(first)) {
				first = at
			}
		}
	}
	return first
}

// runCtx is what a long scenario's relay and its looks at the stream run
// on: the test's own lifetime, not a budget of minutes. At nice 10 beside
// six busy loops such a test ran past its ten minutes, and every look made
// with the expired ctx failed at once ("the 4-partition durables were not
// removed after draining", with the removal logged a minute before). The
// progress waits are the assertions, and go test's -timeout the guard
// against a hang.
func runCtx(t *testing.T) context.Context { return t.Context() }

// waitProgress waits until read reaches want, failing the test only when
// it stops growing for stall: a liveness bound computed from progress, so
// that a relay (or a group) that moves slowly on a loaded box is given the
// time it needs and one that stops is still caught. The test's context
// bounds the whole.
func (s *scenario) waitProgress(what string, want int64, stall time.Duration, read func() int64) {
	s.t.Helper()
	last, since := int64(-1), time.Now()
	for {
		got := read()
		if got >= want {
			return
		}
		if got > last {
			last, since = got, time.Now()
		} else if time.Since(since) > stall {
			s.t.Fatalf("%s: %d of %d, no progress for %s", what, got, want, stall)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// waitStored waits until the stream holds n messages (waitProgress).
func (s *scenario) waitStored(ctx context.Context, n int) {
	s.t.Helper()
	s.waitProgress("events stored in stream "+s.f.Stream, int64(n), 2*time.Minute, func() int64 {
		return int64(relaytest.StreamCount(ctx, s.f.JS, s.f.Stream))
	})
}

// waitApplied waits until n events are applied (waitProgress).
func (s *scenario) waitApplied(n int) {
	s.t.Helper()
	s.waitProgress("events applied", int64(n), 3*time.Minute, s.applied)
}
