package relay

import (
	"context"
	"errors"
	"math"
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

	mu    sync.Mutex
	watch *replication.PublicationWatch
	// ident is the publication's identity at the last right check; "" until
	// the first (whose problem, at start, is an operator's to fix).
	ident string
	// gap is set when rows may have been withheld since safe, until
	// fillGap has published them.
	gap bool
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
func (g *pubGuard) check(ctx context.Context) (replication.PublicationProbe, bool, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.watch == nil {
		w, err := replication.NewPublicationWatch(g.cfg)
		if err != nil {
			return replication.PublicationProbe{}, g.gap, err
		}
		g.watch = w
	}
	p, err := g.watch.Probe(ctx)
	var pgErr *pgconn.PgError
	g.shutdown.Store(errors.As(err, &pgErr) && pgErr.Code == pgerrcode.CannotConnectNow)
	if err != nil {
		return p, g.gap, err
	}
	vouched := g.ident != ""
	switch {
	case p.Problem != nil:
		g.gap = g.gap || vouched
	case vouched && p.Identity != g.ident:
		g.gap, g.ident = true, p.Identity
	default:
		g.ident = p.Identity
		if !g.gap {
			g.raise(p.WAL)
		}
	}
	return p, g.gap, nil
}

// filled records that the rows withheld before wal are published.
func (g *pubGuard) filled(wal replication.LSN) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.gap = false
	g.raise(wal)
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
	p, gap, err := r.guard.check(cctx)
	cancel()
	if err != nil {
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
	p, gap, err := r.guard.check(cctx)
	cancel()
	if err != nil {
		if failOnError {
			return err
		}
		if ctx.Err() == nil && !r.probeFailing.Swap(true) {
			r.log.Warn("could not check the publication; confirming nothing newer until a check succeeds", zap.Error(err))
		}
		return nil
	}
	if r.probeFailing.Swap(false) {
		r.log.Info("publication checks work again")
	}
	r.recordPublication(p.Problem, gap)
	if gap {
		return gapError{p.Problem}
	}
	return nil
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
	r.ready(r.streaming.Load() && r.pubProblem.Load() == nil && r.streamProblem.Load() == nil)
}
