package relay

import (
	"context"
	"errors"
	"time"

	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/router"
	"github.com/outbox-relay/outbox-relay/watermark"
)

// pipeline is one replication session's read → route → publish loop. It
// runs on one goroutine, which owns the replication connection. It reaches
// the stream and the publishers through the narrow interfaces below, so
// its settle, watermark and dead-letter logic is tested without servers.
type pipeline struct {
	r  *Relay // configuration, router, observer, logger, the paused flag
	st changeStream
	// events returns where routed events go now (the batch or the per-key
	// publisher); deadLetters takes the records of unroutable rows.
	events      func() publishTarget
	deadLetters publishTarget
	tracker     *watermark.Tracker

	tx     *watermark.Tx
	commit router.CommitInfo
	msgs   messagePrefixes
	// spans makes the relay's batch spans (nil: off; tracing.go). The
	// pipeline goroutine owns the open batch: it closes it at commits, on
	// a Wake between transactions, when intake pauses and at the end.
	spans *batchSpans
	wait  *time.Timer // reused by pause: a context per wait allocated
	// pausedLog is when admitTx last warned; later pauses within
	// StallWarning log at debug level.
	pausedLog time.Time
}

// changeStream is what the pipeline reads: a replication session.
type changeStream interface {
	// Next returns the next change (*replication.Begin, *Insert, *Commit,
	// *Truncate, *Message; others are skipped).
	Next(ctx context.Context) (any, error)
	// Heartbeat sends a standby status update if one is due.
	Heartbeat(ctx context.Context) error
}

// publishTarget is what the pipeline hands messages to.
type publishTarget interface {
	TryPublish(m *publisher.Message) (bool, error)
	Space() <-chan struct{}
}

// waitSlice is how long the loop waits for publish capacity before it sends
// a status update and waits again.
const waitSlice = 200 * time.Millisecond

func (p *pipeline) run(ctx context.Context) error {
	defer p.spans.close()
	for {
		ev, err := p.st.Next(ctx)
		if err != nil {
			return err
		}
		switch e := ev.(type) {
		case *replication.Begin:
			if err := p.admitTx(ctx); err != nil {
				return err
			}
			p.tx = p.tracker.Begin(e.CommitTime)
			p.commit = router.CommitInfo{LSN: e.FinalLSN, Time: e.CommitTime}
		case *replication.Insert:
			if err := p.insert(ctx, e); err != nil {
				return err
			}
		case *replication.Commit:
			p.tx.Commit(e.EndLSN)
			p.tx = nil
			p.spans.commit()
		case *replication.Wake:
			// The stream was quiet for the batch span's time bound (it
			// asked for this Wake), or has nothing more waiting once
			// past it: between transactions, nothing more joins the
			// batch for now, unless a backlog is still coming.
			if p.tx == nil {
				p.spans.quiet()
			}
		case *replication.Truncate:
			names := make([]string, len(e.Relations))
			for i, rel := range e.Relations {
				names[i] = rel.QualifiedName()
			}
			p.r.log.Warn("outbox table truncated: rows are removed, no events are published", zap.Strings("tables", names))
		case *replication.Message:
			if err := p.message(ctx, e); err != nil {
				return err
			}
		}
	}
}

// admitTx waits, still answering the server, while the transactions behind
// the watermark are at the bound (MaxUnsettledTxs, MaxUnsettledBytes).
// Every transaction read so far is committed here, so what it waits for is
// acks only: nothing it holds back is needed to make progress.
func (p *pipeline) admitTx(ctx context.Context) error {
	cfg := &p.r.cfg
	// over reports whether the tail is at the bounds scaled by num/4:
	// intake stops at the bounds and resumes below three quarters of them,
	// so a tail that drains slowly does not pause and resume per
	// transaction.
	// max(1, …): for a bound of 1, three quarters round down to 0 and
	// intake would never resume.
	over := func(num int) (int, uint64, bool) {
		txs, walBytes := p.tracker.Unsettled()
		return txs, walBytes, txs >= max(1, cfg.MaxUnsettledTxs*num/4) || walBytes >= max(1, uint64(cfg.MaxUnsettledBytes)*uint64(num)/4)
	}
	txs, walBytes, ok := over(4)
	if !ok {
		return nil
	}
	// While paused, the open batch span's rows may all be settled: let it
	// end rather than wait for the pause.
	p.spans.close()
	p.r.paused.Store(true)
	defer p.r.paused.Store(false)
	log := p.r.log.Debug
	if time.Since(p.pausedLog) >= p.r.cfg.StallWarning {
		log, p.pausedLog = p.r.log.Warn, time.Now()
	}
	log("intake paused: too much published behind the watermark; reading the WAL again once it moves",
		zap.Int("unsettled_transactions", txs), zap.Int("max_unsettled_transactions", cfg.MaxUnsettledTxs),
		zap.Uint64("unsettled_wal_bytes", walBytes), zap.Int64("max_unsettled_bytes", cfg.MaxUnsettledBytes),
		zap.Stringer("confirmed_lsn", p.tracker.Confirmed()))
	for {
		if err := p.pause(ctx, p.tracker.Advanced()); err != nil {
			return err
		}
		if _, _, ok := over(3); !ok {
			p.r.log.Debug("intake resumed", zap.Stringer("confirmed_lsn", p.tracker.Confirmed()))
			return nil
		}
	}
}

// message relays a table-less event written with pg_logical_emit_message.
func (p *pipeline) message(ctx context.Context, msg *replication.Message) error {
	if !p.msgs[msg.Prefix] {
		return nil // another application's prefix
	}
	if p.tx == nil {
		// A non-transactional message comes outside any transaction: give
		// it one of its own, confirmable at its LSN once dead-lettered,
		// admitted like any other.
		if err := p.admitTx(ctx); err != nil {
			return err
		}
		tx := p.tracker.Begin(time.Now())
		defer tx.Commit(msg.LSN)
		saved := p.commit
		p.tx, p.commit = tx, router.CommitInfo{LSN: msg.LSN}
		defer func() { p.tx, p.commit = nil, saved }()
	}
	rt := p.r.router
	env, err := envelope(msg)
	if err == nil {
		var rm *router.Message
		if rm, err = rt.RouteEnvelope(msg, env, p.commit); err == nil {
			return p.publishEvent(ctx, rm)
		}
	}
	return p.deadLetter(ctx, rt.DeadLetterLogical(msg, env, p.commit, err), err, router.MessageTable(msg.Prefix), msg.LSN)
}

// insert maps a row and publishes it, or dead-letters it with the router's
// reason.
func (p *pipeline) insert(ctx context.Context, ins *replication.Insert) error {
	rm, err := p.r.router.Route(ins, p.commit)
	if err != nil {
		return p.deadLetter(ctx, p.r.router.DeadLetter(ins, p.commit, err), err, ins.Relation.QualifiedName(), ins.LSN)
	}
	return p.publishEvent(ctx, rm)
}

// deadLetter publishes the record of an unroutable row or message; it
// still holds back the watermark until the record is acked.
func (p *pipeline) deadLetter(ctx context.Context, dl *router.Message, reason error, table string, lsn replication.LSN) error {
	r := p.r
	r.obs.Unroutable(reasonClass(reason))
	r.log.Warn("dead-lettering unroutable row", zap.String("table", table), zap.Stringer("lsn", lsn), zap.Error(reason))
	o := &outbound{r: r, tx: p.tx, commitTime: p.commit.Time}
	o.msg = publisher.Message{Subject: dl.Subject, Header: dl.Header, Data: dl.Data, Owner: o}
	o.tx.Add()
	return p.publish(ctx, p.deadLetters, &o.msg)
}

// publishEvent publishes a routed event.
func (p *pipeline) publishEvent(ctx context.Context, rm *router.Message) error {
	e := &eventOutbound{outbound{r: p.r, tx: p.tx, commitTime: p.commit.Time, rm: rm}}
	o := &e.outbound
	p.spans.join(o)
	o.msg = publisher.Message{Subject: rm.Subject, Header: rm.Header, Data: rm.Data, HeaderLen: rm.HeaderLen, Key: rm.Key, Owner: e}
	o.tx.Add()
	return p.publish(ctx, p.events(), &o.msg)
}

// outbound is one row on its way through the publisher, and its message's
// publisher.Owner: the message points back to it, so handing it over
// allocates no callback.
type outbound struct {
	msg        publisher.Message
	r          *Relay
	tx         *watermark.Tx
	commitTime time.Time
	rm         *router.Message // nil for a dead-letter record
	span       *batchSpan      // the relay span, when on (tracing.go)
}

// Settled implements publisher.Owner.
func (o *outbound) Settled(res publisher.Result) {
	o.tx.Settle()
	o.endSpan(res)
	o.r.obs.Settled(res, o.commitTime)
}

// eventOutbound is an event's outbound, whose message has a dead-letter
// record (a record's own has none: a rejected record is retried).
type eventOutbound struct{ outbound }

// DeadLetter implements publisher.DeadLetterer.
func (e *eventOutbound) DeadLetter(reason error) *publisher.Message {
	dl := e.r.router.DeadLetterMessage(e.rm, reason)
	return &publisher.Message{Subject: dl.Subject, Header: dl.Header, Data: dl.Data}
}

// publish hands m to pub, waiting for capacity without going silent
// towards PostgreSQL.
func (p *pipeline) publish(ctx context.Context, pub publishTarget, m *publisher.Message) error {
	for {
		ok, err := pub.TryPublish(m)
		if err != nil {
			return err
		}
		if ok {
			return nil
		}
		if err := p.pause(ctx, pub.Space()); err != nil {
			return err
		}
	}
}

// pause waits for a signal on ch, at most waitSlice, then sends a status
// update if one is due: the server hears from the relay while it waits.
func (p *pipeline) pause(ctx context.Context, ch <-chan struct{}) error {
	if p.wait == nil {
		p.wait = time.NewTimer(waitSlice)
	} else {
		p.wait.Reset(waitSlice)
	}
	select {
	case <-ch:
	case <-p.wait.C:
		// Only time to tell the server we are alive.
	case <-ctx.Done():
		p.wait.Stop()
		return ctx.Err()
	}
	p.wait.Stop()
	return p.st.Heartbeat(ctx)
}

func reasonClass(err error) string {
	var rc router.ReasonClasser
	if errors.As(err, &rc) {
		return rc.ReasonClass()
	}
	return "unknown"
}
