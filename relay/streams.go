package relay

import (
	"context"
	"errors"
	"fmt"
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
// verdict, and so readiness, stands, and the outage is logged once. After
// streamsUnreadChecks such checks in a row the relay is not ready until
// one reads them (StreamsUnread): a server without JetStream, or a user
// no longer allowed its API, looks the same as a slow answer, and lasts.
func (r *Relay) watchStreams(ctx context.Context) {
	t := time.NewTicker(r.cfg.PublicationCheck)
	defer t.Stop()
	cfg := r.cfg
	cfg.CreateStreams = false
	cfg.Stream.UpdatePartitions, cfg.DeadLetterStream.UpdatePartitions = false, false
	var warned []string
	unread := 0 // checks in a row that could not read a stream
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
			unread++
			switch unread {
			case 1:
				r.log.Warn("could not check the streams; the last check's verdict stands until one can read them", zap.Error(err), zap.Int("not_ready_after_checks", streamsUnreadChecks))
			case streamsUnreadChecks:
				e := fmt.Errorf("the streams could not be read in %d checks in a row (is JetStream enabled for the relay's account, and may its user use the JetStream API?): %w", unread, err)
				r.streamsUnread.Store(&e)
				r.log.Error("stream checks cannot read the streams: not ready until one can", zap.Error(e))
				r.setReady()
			}
			continue
		}
		if unread > 0 {
			unread = 0
			r.log.Info("stream checks read the streams again")
			if r.streamsUnread.Swap(nil) != nil {
				r.setReady()
			}
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

// streamsUnreadChecks is how many stream checks in a row may fail to read
// the streams before the relay is not ready: one or two are a loaded
// server answering late (internal/grouptest beside six busy loops saw
// single ones a minute apart); more is a broker that will not answer.
const streamsUnreadChecks = 3

// StreamsUnread returns why the stream checks have not read the streams
// for streamsUnreadChecks checks in a row, or nil.
func (r *Relay) StreamsUnread() error {
	if p := r.streamsUnread.Load(); p != nil {
		return *p
	}
	return nil
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
