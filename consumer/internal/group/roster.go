package group

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/consumer/internal/observe"
)

// roster is a member's view of the live members of its group, kept by one
// watch of the group bucket for the whole Run (watchRoster) rather than
// listed anew at every step. A fresh listing races with the heartbeats:
// a member whose put replaces its previous entry while the listing's
// consumer is being created could be missing from that listing, and the
// lister then took that member's partitions for a step and handed its own
// back (seen in the consumer-group benchmark: two partitions idle for two
// seconds, one member's shutdown held for AckWait). A watch sees every
// heartbeat as it is stored, and costs the server one consumer per member
// instead of one per member per step.
//
// A member counts as live until the bucket's TTL has passed since its last
// heartbeat was received here (entries the watch reads at its start count
// from then), or until it deletes its entry when it leaves.
type roster struct {
	mu    sync.Mutex
	seen  map[string]rosterEntry
	ready chan struct{} // closed once the watch has read the bucket's entries
	once  sync.Once
	// changed receives (without blocking) when a member joins or leaves
	// by deleting its entry, so that the coordinator reassigns at once
	// rather than at its next tick: a voluntary hand-off in well under a
	// heartbeat interval.
	changed chan struct{}
	// failed is why the last watch ended, nil once a watch has read the
	// bucket: members names it while the roster is not read.
	failed error
	// own is this member's id. ownWant is the revision of a heartbeat of
	// its own, stored at ownSince, that the watch has not delivered yet
	// (0: none). ownLast is the revision of its last heartbeat, stored
	// while the bucket was opened for the ownOpens-th time. heard is when
	// the watch last delivered an entry (ownHeard).
	own      string
	ownWant  uint64
	ownSince time.Time
	ownLast  uint64
	ownOpens uint64
	heard    time.Time
	// conn is the connection's reconnect count at the last heartbeat;
	// connSince, when a heartbeat found it changed (zero: no reconnect
	// to check).
	conn      uint64
	connSince time.Time
}

// beatStored is a heartbeat of this member, as ownHeard reads it.
type beatStored struct {
	rev   uint64 // its revision
	opens uint64 // the bucket's openings when it was stored
	// reconnects is the connection's reconnect count after the put.
	reconnects uint64
	sent, at   time.Time // before the put, and after it
}

// staleWatchTTLs is how many member TTLs a watch that delivers entries
// may go without delivering one of this member's heartbeats before it is
// started anew. More than one: on a starved machine (the group tests at
// nice 10 beside six busy loops) a watch that works delivers them more
// than a TTL late, and starting it anew then only added a consumer's
// creation to the server's load. A watch that has delivered nothing at
// all for the last TTL is started anew after one, as before.
const staleWatchTTLs = 3

// ownHeard notes this member's heartbeat b and returns why the watch must
// start anew, or nil. It must when it watches a bucket that is gone: one
// deleted and created again by someone else (by the other member whose
// heartbeat failed first, say), or a watch whose consumer a restarted NATS
// server lost, until nats.go's ordered consumer notices (two missed idle
// heartbeats, 10 s). This member's puts then succeed, so nothing else
// tells it, while the watch delivers nothing: nats.go's ordered consumer
// follows a new bucket only from the old one's last sequence on, or not at
// all, and the roster empties, this member included. The signs:
//   - the put's revision is not above the previous one stored since the
//     same opening: a stream's sequence never goes back, so the bucket's
//     stream is a new one. This tells at the first heartbeat after, unless
//     the old bucket was younger than the new one.
//   - the connection reconnected before the previous heartbeat, and the
//     watch has delivered nothing since that one was sent. A reconnect to
//     a server that kept the watch's consumer (a link that dropped) needs
//     nothing, and the watch delivers that heartbeat at once; starting it
//     anew at every reconnect of a flapping link left it no time to read.
//   - the watch has delivered none of this member's heartbeats for a
//     member TTL, and nothing at all for the last TTL;
//   - it has delivered entries, but none of this member's heartbeats, for
//     staleWatchTTLs member TTLs.
//
// An opening of the bucket (opens changed) restarts the watch anyway: the
// count starts again from the first heartbeat after it.
func (r *roster) ownHeard(b beatStored, ttl time.Duration) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	last, sameOpening := r.ownLast, b.opens == r.ownOpens
	r.ownLast, r.ownOpens = b.rev, b.opens
	// Not across an opening, which restarts the watch anyway (the first
	// heartbeat is one).
	reconnected := sameOpening && b.reconnects != r.conn
	pending := r.connSince
	r.conn, r.connSince = b.reconnects, time.Time{}
	if reconnected {
		r.connSince = b.sent
	}
	waited := b.at.Sub(r.ownSince)
	var why error
	switch {
	case !sameOpening:
	case b.rev <= last:
		why = fmt.Errorf("%w: this member's heartbeat was stored at revision %d after %d", errBucketCreatedAgain, b.rev, last)
	case !pending.IsZero() && !reconnected && !r.heard.After(pending):
		why = errReconnected
	case r.ownWant != 0 && waited > ttl && b.at.Sub(r.heard) > ttl: // a zero heard is long ago
		why = fmt.Errorf("%w for %s, nor anything at all for a member TTL", errWatchStale, waited.Round(time.Millisecond))
	case r.ownWant != 0 && waited > staleWatchTTLs*ttl:
		why = fmt.Errorf("%w for %s", errWatchStale, waited.Round(time.Millisecond))
	case r.ownWant != 0:
		return nil // the watch has yet to deliver an earlier one
	}
	if why != nil {
		r.connSince = time.Time{} // the watch starts anew
	}
	// The watch (the one started anew, if any) is to deliver this one.
	r.ownWant, r.ownSince = b.rev, b.at
	return why
}

// setFailed records why a watch ended.
func (r *roster) setFailed(err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.failed = err
}

// notRead is members' error while the watch has not read the bucket.
func (r *roster) notRead() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.failed == nil {
		return errRosterNotReady
	}
	return fmt.Errorf("%w: %w", errRosterNotReady, r.failed)
}

type rosterEntry struct {
	partitions int
	until      time.Time
	// rev is the entry's revision: a watch started anew replays the
	// bucket's entries, and a replay of one already seen says nothing of
	// the member's life since, so it does not renew until. The entry is
	// kept (not live) until forget, a TTL past until, so that a replay
	// arriving just after it expired does not bring a dead member back.
	rev    uint64
	forget time.Time
}

func newRoster(own string) *roster {
	return &roster{seen: map[string]rosterEntry{}, ready: make(chan struct{}), changed: make(chan struct{}, 1), own: own}
}

// live returns the members seen alive, sorted by id.
func (r *roster) live(now time.Time) []memberInfo {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]memberInfo, 0, len(r.seen))
	for id, e := range r.seen {
		switch {
		case now.Before(e.until):
			out = append(out, memberInfo{id: id, partitions: e.partitions})
		case now.After(e.forget):
			delete(r.seen, id)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].id < out[j].id })
	return out
}

// nextExpiry is when the first member seen alive runs out of TTL after
// now (zero when none will): the coordinator steps then, so that a dead
// member's partitions move as soon as it counts as dead rather than at the
// next tick, up to a heartbeat interval later. Entries already past are
// left to the tick: a step that fails before it reads the roster must not
// make the coordinator spin.
func (r *roster) nextExpiry(now time.Time) time.Time {
	r.mu.Lock()
	defer r.mu.Unlock()
	var first time.Time
	for _, e := range r.seen {
		if e.until.After(now) && (first.IsZero() || e.until.Before(first)) {
			first = e.until
		}
	}
	return first
}

func (r *roster) update(e jetstream.KeyValueEntry, ttl time.Duration, now time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	cur, ok := r.seen[e.Key()]
	known := ok && now.Before(cur.until)
	r.heard = now
	if e.Key() == r.own && e.Revision() >= r.ownWant {
		r.ownWant = 0 // the watch delivers this member's heartbeats
	}
	if e.Operation() != jetstream.KeyValuePut {
		delete(r.seen, e.Key()) // the member left
		r.notify(known)
		return
	}
	n, _ := strconv.Atoi(string(e.Value()))
	if ok && cur.rev == e.Revision() {
		return // a replay (a watch started anew): no heartbeat since
	}
	r.seen[e.Key()] = rosterEntry{partitions: n, until: now.Add(ttl), rev: e.Revision(), forget: now.Add(2 * ttl)}
	r.notify(!known)
}

func (r *roster) notify(changed bool) {
	if changed {
		select {
		case r.changed <- struct{}{}:
		default:
		}
	}
}

// watchRoster keeps g.roster until ctx ends, watching again after a watch
// ends (the connection closed, the bucket was re-created).
func (g *Member) watchRoster(ctx context.Context) {
	var failing observe.LoopHealth
	for ctx.Err() == nil {
		err := g.watchOnce(ctx)
		if ctx.Err() != nil {
			return
		}
		g.roster.setFailed(err)
		failing.Report(g.log, "watch group members", err)
		select {
		case <-ctx.Done():
			return
		case <-time.After(g.ttl / 6):
		}
	}
}

func (g *Member) watchOnce(ctx context.Context) error {
	g.dropRestarts()
	w, err := g.bucket().WatchAll(ctx)
	// The watch subscribes through nats.go's older JetStream API, whose
	// errors are its own.
	if errors.Is(err, jetstream.ErrBucketNotFound) || errors.Is(err, jetstream.ErrStreamNotFound) || errors.Is(err, nats.ErrStreamNotFound) {
		// Lost (an operator deleted it, a restart lost a memory bucket)
		// before anything heartbeats: a member that has not joined yet
		// would otherwise wait for it for ever.
		if oerr := g.openBucket(ctx); oerr != nil {
			return errors.Join(err, oerr)
		}
		g.dropRestarts() // the reopening signalled this watch
		w, err = g.bucket().WatchAll(ctx)
	}
	if err != nil {
		return err
	}
	defer func() { _ = w.Stop() }()
	for {
		select {
		case e, ok := <-w.Updates():
			if !ok {
				return errWatchEnded
			}
			if e == nil {
				g.roster.setFailed(nil)
				g.roster.once.Do(func() { close(g.roster.ready) })
				continue
			}
			g.roster.update(e, g.ttl, time.Now())
		case <-g.rewatch:
			return errBucketReopened
		case why := <-g.restale:
			return why
		case <-ctx.Done():
			return nil
		}
	}
}

// dropRestarts drops the signals to start the watch anew (a reopened
// bucket, a stale watch) that the watch about to start makes moot: it
// watches the bucket as now opened.
func (g *Member) dropRestarts() {
	select {
	case <-g.rewatch:
	default:
	}
	select {
	case <-g.restale:
	default:
	}
}

// members returns the live members, once the roster has read the bucket.
// It waits at most one member TTL, so that the coordinator loop keeps
// checking its own heartbeat while the bucket cannot be watched.
func (g *Member) members(ctx context.Context) ([]memberInfo, error) {
	t := time.NewTimer(g.ttl)
	defer t.Stop()
	select {
	case <-g.roster.ready:
	case <-t.C:
		return nil, g.roster.notRead()
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return g.roster.live(time.Now()), nil
}

var errRosterNotReady = errors.New("the group bucket's members are not read yet (its watch keeps failing)")

var errWatchEnded = errors.New("the group bucket's watch ended")

var errBucketReopened = errors.New("the group bucket was opened again (created anew after it was lost)")

// errWatchAnew wraps each reason the heartbeat gives for starting the
// watch anew.
var errWatchAnew = errors.New("watching the group bucket anew")

var errWatchStale = fmt.Errorf("%w: its watch had delivered none of this member's heartbeats", errWatchAnew)

var errBucketCreatedAgain = fmt.Errorf("%w: it was deleted and created again by someone else", errWatchAnew)

var errReconnected = fmt.Errorf("%w: after the connection to NATS reconnected its watch delivered nothing, as when a restarted server lost the watch's consumer", errWatchAnew)
