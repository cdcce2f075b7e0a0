package relay

import (
	"context"
	"errors"
	"slices"
	"time"

	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/provision"
)

// StreamProblem returns what the last check of the event and dead-letter
// streams while running found wrong (the stream gone, its subjects no
// longer covering the subject template, whatever else
// provision.EnsureStream refuses), or nil.
func (r *Relay) StreamProblem() error {
	if p := r.streamProblem.Load(); p != nil {
		return *p
	}
	return nil
}

// watchStreams checks the streams every PublicationCheck until ctx ends,
// with the check that runs at start (provision.EnsureStream, never
// creating or changing anything): someone may edit a stream under the
// running relay. A refusal makes the relay not ready and is logged once
// per change; warnings new since the last check (a duplicate window
// shortened, acks no longer durable) are logged once. A check that could
// not read a stream (provision.ErrNotRead: a loaded server's answer later
// than the check's deadline, a broker away) learnt nothing: the last
// verdict, and so readiness, stands, and the outage is logged once.
func (r *Relay) watchStreams(ctx context.Context) {
	t := time.NewTicker(r.cfg.PublicationCheck)
	defer t.Stop()
	cfg := r.cfg
	cfg.CreateStreams = false
	cfg.Stream.UpdatePartitions, cfg.DeadLetterStream.UpdatePartitions = false, false
	var warned []string
	unread := false // the last check could not read a stream
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		cctx, cancel := context.WithTimeout(ctx, r.probeTimeout())
		reps, err := ensureStreams(cctx, r.js, cfg, r.log)
		cancel()
		if ctx.Err() != nil {
			return
		}
		if errors.Is(err, provision.ErrNotRead) {
			if !unread {
				unread = true
				r.log.Warn("could not check the streams; the last check's verdict stands until one can read them", zap.Error(err))
			}
			continue
		}
		if unread {
			unread = false
			r.log.Info("stream checks read the streams again")
		}
		r.recordStreams(err)
		if err != nil {
			continue
		}
		var now []string
		for _, rep := range reps {
			now = append(now, rep.Warnings...)
		}
		for _, w := range now {
			if !slices.Contains(warned, w) {
				r.log.Warn(w, zap.String("noticed", "while running"))
			}
		}
		warned = now
	}
}

// recordStreams records a check's verdict for readiness and logs when it
// changes.
func (r *Relay) recordStreams(err error) {
	var old *error
	if err == nil {
		if old = r.streamProblem.Swap(nil); old != nil {
			r.log.Info("streams right again")
		}
	} else if old = r.streamProblem.Swap(&err); old == nil || (*old).Error() != err.Error() {
		r.log.Error("stream changed under the running relay: not ready until it is fixed", zap.Error(err))
	}
	r.setReady()
}
