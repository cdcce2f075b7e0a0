package relay

import (
	"context"
	"errors"
	"time"

	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/replication"
)

// PublicationProblem returns what the last publication check found wrong
// (a replication.ErrPublicationMismatch, ErrPublicationMissing or
// ErrTableMissing naming the fix), or nil.
func (r *Relay) PublicationProblem() error {
	if p := r.pubProblem.Load(); p != nil {
		return *p
	}
	return nil
}

// checkPublication checks the publication, records the verdict and returns
// a problem, if any. An error that is no verdict (the database is
// unreachable) changes nothing: the session that needs it fails anyway.
func (r *Relay) checkPublication(ctx context.Context) error {
	err := replication.CheckPublication(ctx, r.cfg.Replication)
	switch {
	case err == nil:
		if r.pubProblem.Swap(nil) != nil {
			r.log.Info("publication fixed", zap.String("publication", r.cfg.Replication.Publication))
		}
	case isPublicationProblem(err):
		if old := r.pubProblem.Swap(&err); old == nil || (*old).Error() != err.Error() {
			r.log.Error("publication wrong: not ready until it is fixed", zap.Error(err))
		}
	default:
		return err
	}
	r.setReady()
	return err
}

func isPublicationProblem(err error) bool {
	return errors.Is(err, replication.ErrPublicationMismatch) || errors.Is(err, replication.ErrPublicationMissing) ||
		errors.Is(err, replication.ErrTableMissing)
}

// watchPublication re-checks the publication every PublicationCheck until
// ctx ends: someone may drop a table from it, or make it publish updates,
// while the relay runs.
func (r *Relay) watchPublication(ctx context.Context) {
	t := time.NewTicker(r.cfg.PublicationCheck)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if !r.streaming.Load() {
				continue // the next session checks before it starts
			}
			cctx, cancel := context.WithTimeout(ctx, r.cfg.PublicationCheck)
			if err := r.checkPublication(cctx); err != nil && !isPublicationProblem(err) && ctx.Err() == nil {
				r.log.Warn("could not check the publication", zap.Error(err))
			}
			cancel()
		}
	}
}

// setReady tells the readiness callback whether the relay streams with a
// right publication.
func (r *Relay) setReady() {
	r.readyMu.Lock()
	defer r.readyMu.Unlock()
	r.ready(r.streaming.Load() && r.pubProblem.Load() == nil)
}
