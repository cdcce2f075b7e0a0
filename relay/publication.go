package relay

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/replication"
)

// ErrPublicationGap means that while the relay streamed, a check found the
// publication wrong, or redefined since the check before (a table dropped
// from it and added back, a publish option switched off and on): rows
// written meanwhile may have been withheld from the stream, and pgoutput
// never sends them, not even to a session started before them. The relay
// stops streaming and confirming, waits until the publication is right,
// publishes the outbox rows the event stream lacks in aggregate order
// (fillGap), and only then streams again.
var ErrPublicationGap = errors.New("the publication may have withheld outbox rows")

// gapError is ErrPublicationGap with what the check found, if anything:
// it wraps both. The problem, permanent at start, is waited out here
// (Relay.stream).
type gapError struct{ problem error }

func (e gapError) Error() string {
	if e.problem == nil {
		return ErrPublicationGap.Error() + ": the publication was redefined since it was last checked; publishing the rows the event stream lacks before streaming again"
	}
	return ErrPublicationGap.Error() + ": " + e.problem.Error() + " (the relay stops streaming until it is fixed, then publishes the rows the event stream lacks)"
}

func (e gapError) Unwrap() []error {
	if e.problem == nil {
		return []error{ErrPublicationGap}
	}
	return []error{ErrPublicationGap, e.problem}
}

// pubGuard holds what the publication checks allow the stream to confirm.
// Its verdicts come from one probe at a time (mu): the watcher's, the
// session's at a Relation message, and the one before each session.
type pubGuard struct {
	cfg replication.Config
	log *zap.Logger

	mu    sync.Mutex
	watch *replication.PublicationWatch
	// ident is the publication's identity at the last right check; "" until
	// the first (whose problem, at start, is an operator's to fix).
	ident string
	// gap is set when rows may have been withheld since safe, until
	// fillGap has published them. It is kept in replication.GapTable too
	// (recorded), for the relay that streams the slot next: this one may
	// stop before the gap is filled.
	gap, recorded bool
	// undecodable is set when the slot cannot decode the gap's stretch
	// (the publication was dropped and created again: pgoutput fails with
	// 42704 on every change before the new one): after the fill the slot
	// is advanced past it.
	undecodable bool
	// recordFailed is set while the gap cannot be recorded, so that it
	// logs once.
	recordFailed bool
	// safe is the WAL position read before the last right check with
	// nothing withheld before it: the stream never confirms past it.
	safe atomic.Uint64
	// shutdown is set while the server refuses connections because it is
	// shutting down (SQLSTATE 57P03): no check can run, and its walsender
	// waits, before the server may stop, for the relay to confirm the
	// shutdown checkpoint. Capped, the relay would hold a fast shutdown
	// until pg_ctl gives up. The cap is lifted until a check succeeds
	// again; a publication changed in between is still found by that
	// check (its identity), and the gap filled from the table.
	shutdown atomic.Bool
}

// limit is the stream's confirm limit.
func (g *pubGuard) limit() replication.LSN {
	if g.shutdown.Load() {
		return replication.LSN(math.MaxUint64)
	}
	return replication.LSN(g.safe.Load())
}

// check probes the publication and returns the probe and whether rows may
// have been withheld since the last right check. An error is no verdict.
// Before a session (atStart) it also reads the gap a relay recorded
// before: one that stopped, or lost the slot, before filling it.
func (g *pubGuard) check(ctx context.Context, atStart bool) (replication.PublicationProbe, bool, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if err := g.open(); err != nil {
		return replication.PublicationProbe{}, g.gap, err
	}
	p, err := g.watch.Probe(ctx)
	var pgErr *pgconn.PgError
	g.shutdown.Store(errors.As(err, &pgErr) && pgErr.Code == pgerrcode.CannotConnectNow)
	if err != nil {
		return p, g.gap, err
	}
	if atStart {
		rec, err := g.watch.Gap(ctx)
		if err != nil {
			return p, g.gap, err
		}
		if rec.Open {
			g.gap, g.recorded = true, true
			g.undecodable = g.undecodable || rec.Undecodable
		}
	}
	vouched := g.ident != ""
	switch {
	case p.Problem != nil:
		g.gap = g.gap || vouched
	case vouched && p.Identity != g.ident:
		// Another publication under the same name: the slot's stretch
		// before it cannot be decoded.
		g.undecodable = g.undecodable || publicationOID(p.Identity) != publicationOID(g.ident)
		g.gap, g.ident = true, p.Identity
	default:
		g.ident = p.Identity
		if !g.gap {
			g.raise(p.WAL)
		}
	}
	g.record(ctx)
	return p, g.gap, nil
}

func (g *pubGuard) open() error {
	if g.watch != nil {
		return nil
	}
	w, err := replication.NewPublicationWatch(g.cfg)
	if err != nil {
		return err
	}
	g.watch = w
	return nil
}

// record writes an open gap to replication.GapTable once. A failure only
// logs: the gap is filled all the same unless this relay stops first,
// which the log names.
func (g *pubGuard) record(ctx context.Context) {
	if !g.gap || g.recorded {
		return
	}
	err := g.watch.RecordGap(ctx, replication.Gap{Since: g.limit(), Undecodable: g.undecodable})
	if err != nil {
		if !g.recordFailed {
			g.log.Error("could not record the publication gap: a relay that stops before it is filled leaves its rows to `outbox-relay reconcile --repair`", zap.Error(err))
		}
		g.recordFailed = true
		return
	}
	g.recorded, g.recordFailed = true, false
}

// publicationOID is the publication row's oid in an identity.
func publicationOID(ident string) string {
	oid, _, _ := strings.Cut(ident, ".")
	return oid
}

// undecodableStretch records that a session failed because the
// publication did not exist at a position it decoded, while a check found
// it existing: it was dropped and created again, and the slot cannot
// decode the stretch in between. The gap is filled, and the slot advanced
// past it, before the next session.
func (g *pubGuard) undecodableStretch() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.ident == "" && !g.gap {
		return // never found right: the publication is missing, as Open says
	}
	g.gap = true
	if !g.undecodable {
		g.undecodable, g.recorded = true, false
	}
}

// fillState returns whether the gap's stretch is undecodable.
func (g *pubGuard) fillState() (undecodable bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.undecodable
}

// settle waits until the outbox writers that may be committing now are
// visible (replication.PublicationWatch.SettleCommits).
func (g *pubGuard) settle(ctx context.Context) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if err := g.open(); err != nil {
		return err
	}
	return g.watch.SettleCommits(ctx)
}

// position reads the server's WAL position now
// (replication.PublicationWatch.Position).
func (g *pubGuard) position(ctx context.Context) (replication.LSN, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if err := g.open(); err != nil {
		return 0, err
	}
	return g.watch.Position(ctx)
}

// stretchMessages reads the logical messages the slot would skip if
// advanced to upto (replication.PublicationWatch.StretchMessages).
func (g *pubGuard) stretchMessages(ctx context.Context, upto replication.LSN, fn func(*replication.StretchMessage) error) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if err := g.open(); err != nil {
		return err
	}
	return g.watch.StretchMessages(ctx, upto, fn)
}

// filled records that the rows withheld before wal are published, first
// advancing the slot to wal when it cannot decode the stretch.
func (g *pubGuard) filled(ctx context.Context, wal replication.LSN) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if err := g.open(); err != nil {
		return err
	}
	if g.undecodable {
		err := g.watch.AdvanceSlot(ctx, wal)
		var pgErr *pgconn.PgError
		switch {
		case errors.As(err, &pgErr) && pgErr.Code == pgerrcode.ObjectInUse:
			// Another session streams the slot (this relay stands by): it
			// got past the stretch, or fails on it, lets go, and the relay
			// that takes the slot over advances it then.
			g.log.Info("publication gap filled; the slot is streamed by another session, which gets past the WAL it cannot decode", zap.Error(err))
		case err != nil:
			return err
		}
	}
	if err := g.watch.ClearGap(ctx); err != nil {
		return err
	}
	g.gap, g.recorded, g.undecodable = false, false, false
	g.raise(wal)
	return nil
}

func (g *pubGuard) raise(wal replication.LSN) {
	if uint64(wal) > g.safe.Load() {
		g.safe.Store(uint64(wal))
	}
}

func (g *pubGuard) close() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.watch != nil {
		g.watch.Close(context.Background())
	}
}

// PublicationProblem returns what the last publication check found wrong
// (a replication.ErrPublicationMismatch, ErrPublicationMissing or
// ErrTableMissing naming the fix, or an ErrPublicationGap until the rows
// it may have withheld are published), or nil.
func (r *Relay) PublicationProblem() error {
	if p := r.pubProblem.Load(); p != nil {
		return *p
	}
	return nil
}

// preparePublication checks the publication before a session. At the
// first check a problem is returned as it is: the relay does not start on
// a wrong publication (a missing one is left to Open, which names a
// missing slot first: setup creates both). Once the relay streamed, a
// problem is waited out (an ErrPublicationGap), and a gap is filled here.
func (r *Relay) preparePublication(ctx context.Context) error {
	cctx, cancel := context.WithTimeout(ctx, r.probeTimeout())
	p, gap, err := r.guard.check(cctx, true)
	cancel()
	if r.checkRan(ctx, err); err != nil {
		return err
	}
	r.recordPublication(p.Problem, gap)
	switch {
	case gap && p.Problem != nil:
		// Hold standbys back too, before one takes the slot once the
		// publication is right again.
		if err := r.holdGapLock(ctx); err != nil {
			return err
		}
		return gapError{p.Problem}
	case gap:
		return r.fillGap(ctx, p.WAL)
	case errors.Is(p.Problem, replication.ErrPublicationMissing):
		return nil
	}
	return p.Problem
}

// verifyStreaming checks the publication during a session. It returns an
// ErrPublicationGap, ending the session, when rows may have been withheld;
// a failure to check returns only when failOnError is set (the Relation
// hook: a change is about to be relayed on the check's word).
func (r *Relay) verifyStreaming(ctx context.Context, failOnError bool) error {
	cctx, cancel := context.WithTimeout(ctx, r.probeTimeout())
	p, gap, err := r.guard.check(cctx, false)
	cancel()
	if r.checkRan(ctx, err); err != nil {
		if failOnError {
			return err
		}
		return nil
	}
	r.recordPublication(p.Problem, gap)
	if gap {
		return gapError{p.Problem}
	}
	return nil
}

// checkRan records whether a publication check could run. While checks
// fail (the database unreachable for the check's connection, a timeout)
// nothing newer is confirmed: the relay is not ready, says why, and logs
// the outage once.
func (r *Relay) checkRan(ctx context.Context, err error) {
	if err == nil {
		if r.checkFailure.Swap(nil) != nil {
			r.log.Info("publication checks work again")
			r.setReady()
		}
		return
	}
	if ctx.Err() != nil {
		return // stopping
	}
	failure := fmt.Errorf("the publication cannot be checked (nothing newer is confirmed until a check succeeds): %w", err)
	if r.checkFailure.Swap(&failure) == nil {
		r.log.Warn("could not check the publication; confirming nothing newer until a check succeeds: not ready", zap.Error(err))
		r.setReady()
	}
}

// PublicationCheckFailure returns why the last publication check could not
// run, or nil when it ran: while checks fail the relay confirms nothing
// newer and is not ready.
func (r *Relay) PublicationCheckFailure() error {
	if p := r.checkFailure.Load(); p != nil {
		return *p
	}
	return nil
}

// NotReadyReason says why the relay is not ready, "" when it is.
func (r *Relay) NotReadyReason() string {
	for _, p := range r.problems() {
		if p != nil {
			return (*p).Error()
		}
	}
	if !r.streaming.Load() {
		return "not streaming"
	}
	return ""
}

// relationChanged is the session's Relation hook: the server describes a
// relation before its first change of a session and again after anything
// invalidated it, ALTER PUBLICATION … ADD TABLE included. Checking here,
// before the change is relayed, keeps a row written after a table was
// added back from overtaking the rows withheld before, however soon after
// a drop it came.
func (r *Relay) relationChanged(ctx context.Context, _ *replication.Relation) error {
	return r.verifyStreaming(ctx, true)
}

// probeTimeout bounds one publication check: a check hung on a dead
// connection holds the confirm limit, and the session's Relation hook,
// until it fails and the next one reconnects.
func (r *Relay) probeTimeout() time.Duration {
	return max(2*r.checkInterval(), 5*time.Second)
}

// checkInterval is how often the publication is checked while streaming:
// at least once per status interval, so that a confirmation is never
// older than one check.
func (r *Relay) checkInterval() time.Duration {
	si := r.cfg.Replication.StatusInterval
	if si <= 0 {
		si = replication.DefaultStatusInterval
	}
	return min(r.cfg.PublicationCheck, si)
}

// recordPublication records a verdict for readiness and the metric, and
// logs when it changes.
func (r *Relay) recordPublication(problem error, gap bool) {
	var now error
	switch {
	case gap:
		now = gapError{problem}
	case problem != nil:
		now = problem
	}
	var old *error
	if now == nil {
		old = r.pubProblem.Swap(nil)
		if old != nil {
			r.log.Info("publication right", zap.String("publication", r.cfg.Replication.Publication))
		}
	} else if old = r.pubProblem.Swap(&now); old == nil || (*old).Error() != now.Error() {
		r.log.Error("publication wrong: not ready until it is fixed", zap.Error(now))
	}
	r.setReady()
}

// watchPublication checks the publication every checkInterval while a
// session streams, until ctx ends: someone may drop a table from it, or
// make it publish updates, while the relay runs. A check that finds rows
// possibly withheld ends the session.
func (r *Relay) watchPublication(ctx context.Context) {
	t := time.NewTicker(r.checkInterval())
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if !r.streaming.Load() {
				continue // the next session checks before it starts
			}
			if err := r.verifyStreaming(ctx, false); err != nil {
				if end := r.endSession.Load(); end != nil {
					(*end)(err)
				}
			}
		}
	}
}

// setReady tells the readiness callback whether the relay streams with a
// right publication and streams.
func (r *Relay) setReady() {
	r.readyMu.Lock()
	defer r.readyMu.Unlock()
	ready := r.streaming.Load()
	for _, p := range r.problems() {
		ready = ready && p == nil
	}
	r.ready(ready)
}

// problems are the readiness inputs that hold why the relay is not ready,
// in the order NotReadyReason names them; the relay is ready when it
// streams and every one is nil.
func (r *Relay) problems() [4]*error {
	return [...]*error{r.pubProblem.Load(), r.checkFailure.Load(), r.streamProblem.Load(), r.streamsUnread.Load()}
}
