package consumer

import (
	"context"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go/jetstream"

	"golang.org/x/sync/errgroup"
)

// engine is one Run of a Consumer: it owns the workers, hands them what its
// source delivers, and stops in order. Everything a run creates lives here
// and dies with it, so a Consumer itself holds configuration only: a later
// run may read a recreated stream whose sequences mean other messages, and
// starts with empty retry counters and held aggregates.
type engine struct {
	c       *Consumer
	src     source
	workers []*worker
}

// source is where an engine's deliveries come from: one plain durable
// consumer (durableSource) or the partitions a group member owns
// (groupSource, over consumer/internal/group). A source feeds the engine's workers through feeds
// (feed.go), which keep each JetStream consumer's deliveries in stream
// order.
type source interface {
	// setUp creates or checks what the source reads before the engine
	// starts its workers: the durable consumer, or the identity a group
	// member records in its partitions' durables.
	setUp(ctx context.Context) error
	// run feeds the engine until ctx ends (then it returns nil) or the
	// source cannot go on. settleCtx is the workers' context, which outlives ctx:
	// a source may hand off at shutdown, letting the workers settle what it
	// handed out. run returns only after every goroutine it started has.
	run(ctx, settleCtx context.Context, e *engine) error
	// gone reports which stream sequences need no further processing by
	// this consumer (acknowledged, or no longer in the stream); one whose
	// state cannot be learnt is not gone.
	gone(ctx context.Context, seqs []uint64) map[uint64]bool
	// forget tells the source that the messages at seqs, naked for a
	// retry, need no redelivery here (found applied by their dedup rows,
	// without asking gone): what the source keeps for their return goes.
	forget(seqs []uint64)
}

// errWorkerStopped ends a run whose worker returned early.
var errWorkerStopped = errors.New("a worker stopped")

// run sets the source up, then runs the workers, the source and the
// replay and statistics loops until ctx ends or one of them fails. The
// workers stop last: they settle what the source handed them while it
// stops, and then give back what they still hold (worker.release). A ctx
// that ends during the set-up is an error, not a shutdown: nothing ran.
func (e *engine) run(ctx context.Context) error {
	c := e.c
	if err := e.src.setUp(ctx); err != nil {
		if cerr := ctx.Err(); cerr != nil && !errors.Is(err, cerr) {
			err = fmt.Errorf("%w: %w", cerr, err)
		}
		return err
	}
	e.workers = make([]*worker, c.cfg.Workers)
	for i := range e.workers {
		e.workers[i] = newWorker(c, e.src, i)
	}
	wctx, wcancel := context.WithCancel(context.WithoutCancel(ctx))
	defer wcancel()
	wg, wgctx := errgroup.WithContext(wctx)
	for _, w := range e.workers {
		wg.Go(func() error { return w.run(wgctx) })
	}
	lg, lctx := errgroup.WithContext(ctx)
	lg.Go(func() error { return e.src.run(lctx, wgctx, e) })
	lg.Go(func() error { return c.replayLoop(lctx, e) })
	lg.Go(func() error { return c.statsLoop(lctx) })
	lg.Go(func() error { // a worker that fails ends the run
		select {
		case <-wgctx.Done():
			return errWorkerStopped
		case <-lctx.Done():
			return nil
		}
	})
	err := lg.Wait()
	wcancel()
	if werr := wg.Wait(); werr != nil || ctx.Err() != nil && !errors.Is(err, errSetUpCancelled) {
		return werr // the cause, when a worker ended the run; nil on shutdown
	}
	return err
}

// send hands it to the worker owning its aggregate, unless ctx ends first.
func (e *engine) send(ctx context.Context, it *item) error {
	select {
	case e.workers[e.c.workerIndex(it.key)].in <- it:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// pump receives from f and sends to the workers until either fails; an
// error comes back as it is (ctx's, or the feed's).
func (e *engine) pump(ctx context.Context, f *feed) error {
	for {
		msg, err := f.recv(ctx)
		if err == nil {
			err = f.forward(ctx, msg)
		}
		if err != nil {
			return err
		}
	}
}

// newSource is the source Config asks for: a group member's partitions
// (group_source.go), or the plain durable consumer (durable.go).
func (c *Consumer) newSource(strm jetstream.Stream) source {
	if c.cfg.Group != nil {
		return c.newGroupSource(strm)
	}
	return &durableSource{c: c, strm: strm}
}
