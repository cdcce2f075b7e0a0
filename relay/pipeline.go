package relay

import (
	"context"
	"errors"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/router"
)

// pipeline is one replication session's read → route → publish loop. It
// runs on one goroutine, which owns the replication connection.
type pipeline struct {
	r       *Relay
	st      *replication.Stream
	tracker *publisher.Tracker

	tx     *publisher.Tx
	commit router.CommitInfo
	msgs   *messageRoutes
	wait   *time.Timer // reused by pause: a context per wait allocated
	// pausedLog is when admitTx last warned; later pauses within
	// StallWarning log at debug level.
	pausedLog time.Time
}

// waitSlice is how long the loop waits for publish capacity before it sends
// a status update and waits again.
const waitSlice = 200 * time.Millisecond

func (p *pipeline) run(ctx context.Context) error {
	defer p.r.closeTxSpan()
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
			p.r.closeTxSpan()
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
	over := func(num int) (int, uint64, bool) {
		txs, walBytes := p.tracker.Unsettled()
		return txs, walBytes, txs >= cfg.MaxUnsettledTxs*num/4 || walBytes >= uint64(cfg.MaxUnsettledBytes)*uint64(num)/4
	}
	txs, walBytes, ok := over(4)
	if !ok {
		return nil
	}
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
	ins, merr, ok := p.msgs.insert(msg)
	if !ok {
		return nil // another application's prefix
	}
	if p.tx == nil {
		// A non-transactional message comes outside any transaction: give
		// it one of its own, confirmable at its LSN once dead-lettered.
		tx := p.tracker.Begin(time.Now())
		defer tx.Commit(msg.LSN)
		saved := p.commit
		p.tx, p.commit = tx, router.CommitInfo{LSN: msg.LSN}
		defer func() { p.tx, p.commit = nil, saved }()
	}
	return p.route(ctx, ins, merr)
}

func (p *pipeline) insert(ctx context.Context, ins *replication.Insert) error {
	return p.route(ctx, ins, nil)
}

// route maps a row (or a logical message's synthetic row) and publishes it,
// or dead-letters it with reason preErr or the router's reason.
func (p *pipeline) route(ctx context.Context, ins *replication.Insert, preErr error) error {
	r := p.r
	o := getOutbound()
	o.r, o.tx, o.commitTime = r, p.tx, p.commit.Time
	err := preErr
	if err == nil {
		o.rm, err = r.router.Route(ins, p.commit)
	}
	if err != nil {
		// Unroutable rows are dead-lettered with the row itself; they still
		// hold back the watermark until the record is acked.
		dl := r.router.DeadLetter(ins, p.commit, err)
		r.obs.Unroutable(reasonClass(err))
		r.log.Warn("dead-lettering unroutable row", zap.String("table", ins.Relation.QualifiedName()), zap.Stringer("lsn", ins.LSN), zap.Error(err))
		o.msg = publisher.Message{Subject: dl.Subject, Header: dl.Header, Data: dl.Data, Done: o.done}
		o.tx.Add()
		return p.publish(ctx, r.pub, &o.msg)
	}
	rm := o.rm
	r.startSpan(o)
	o.msg = publisher.Message{Subject: rm.Subject, Header: rm.Header, Data: rm.Data, HeaderLen: rm.HeaderLen, Key: rm.Key, DeadLetter: o.deadLetter, Done: o.done}
	o.tx.Add()
	return p.publish(ctx, r.eventPublisher(), &o.msg)
}

// outbound is one row on its way through the publisher. It is recycled once
// settled, its Done and DeadLetter functions bound once, so that a row
// costs the pipeline no allocation (three per row otherwise, a tenth of
// the relay's garbage).
type outbound struct {
	msg        publisher.Message
	r          *Relay
	tx         *publisher.Tx
	commitTime time.Time
	rm         *router.Message // nil for a dead-letter record
	span       *txSpan         // the relay span, when on (tracing.go)

	done       func(publisher.Result)
	deadLetter func(error) *publisher.Message
}

// outbounds holds settled outbounds for reuse.
var outbounds sync.Pool

func getOutbound() *outbound {
	if o, ok := outbounds.Get().(*outbound); ok {
		return o
	}
	o := &outbound{}
	o.done, o.deadLetter = o.settled, o.deadLetterRecord
	return o
}

// settled is the message's Done: the publisher reads neither the message
// nor its buffers afterwards.
func (o *outbound) settled(res publisher.Result) {
	o.tx.Settle()
	o.endSpan(res)
	o.r.obs.Settled(res, o.commitTime)
	// Every attempt has returned and the dead-letter record, if any, is
	// built: the router may reuse rm's buffers for a later row.
	o.r.router.Release(o.rm)
	*o = outbound{done: o.done, deadLetter: o.deadLetter}
	outbounds.Put(o)
}

func (o *outbound) deadLetterRecord(reason error) *publisher.Message {
	dl := o.r.router.DeadLetterMessage(o.rm, reason)
	return &publisher.Message{Subject: dl.Subject, Header: dl.Header, Data: dl.Data}
}

// publish hands m to pub, waiting for capacity without going silent
// towards PostgreSQL.
func (p *pipeline) publish(ctx context.Context, pub eventPublisher, m *publisher.Message) error {
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
