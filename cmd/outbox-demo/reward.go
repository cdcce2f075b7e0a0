package main

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/errgroup"

	"github.com/outbox-relay/outbox-relay/consumer"
	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/internal/reward"
)

// The reward stage: the seed lesson's reward service, run in-process on the
// consumer library (package consumer) as cmd/reward-consumer runs it.
const (
	rewardConsumer = "reward-consumer" // durable consumer and dedup key of the library
	rewardLedger   = "reward_account"  // apply_reward_event's own dedup key, as in cmd/reward-consumer
	rewardPoints   = 10
	rewardEvent    = "RegistrationConfirmed"
)

// credit is what the handler did for one event, reported once its
// transaction committed.
type credit struct {
	registration, player string
}

// rewardHandler runs the real reward handler (internal/reward, the one
// cmd/reward-consumer serves) and remembers what it credited until the
// transaction commits, so the demo prints only committed credits.
type rewardHandler struct {
	mu      sync.Mutex
	pending map[string]credit // event id -> credit, until its commit
	applied chan credit       // committed credits, for the demo to print
}

func (h *rewardHandler) Handle(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	inner := reward.Handler{Ledger: rewardLedger, Points: rewardPoints, Applied: func(m *consumer.Message, registration, player uuid.UUID) {
		h.mu.Lock()
		h.pending[m.ID] = credit{registration: registration.String(), player: player.String()}
		h.mu.Unlock()
	}}
	return inner.Handle(ctx, tx, m)
}

// afterCommit reports a credit once its transaction committed.
func (h *rewardHandler) afterCommit(m *consumer.Message) {
	h.mu.Lock()
	c, ok := h.pending[m.ID]
	delete(h.pending, m.ID)
	h.mu.Unlock()
	if ok {
		select {
		case h.applied <- c:
		default:
			// More credits than events: never block the worker; the
			// demo's database check reports the double credit.
		}
	}
}

// rewards runs the reward consumer over the stream: every confirmed
// registration credits its player once, and a duplicate of one event, which
// the demo publishes as a relay would after a crash outside JetStream's
// de-duplication window, is recognised and not applied again.
func (d *demo) rewards(ctx context.Context) error {
	evs, seqs := d.arrivals.expectedEvents()
	d.out.step("reward service: consumer library in-process, crediting %d points per %s through apply_reward_event", rewardPoints, rewardEvent)
	_, pool, err := d.createDatabase(ctx, "rewards", "consumer.sql", "reward.sql")
	if err != nil {
		return err
	}
	players, err := seedRegistrations(ctx, pool, evs) // registration -> player
	if err != nil {
		return err
	}
	d.out.detail("opened %d reward accounts with 0 points, one per registration's player", len(evs))

	h := &rewardHandler{pending: map[string]credit{}, applied: make(chan credit, len(evs)+1)}
	reg := prometheus.NewRegistry()
	c, err := consumer.New(pool, d.js, consumer.Config{
		Name:       rewardConsumer,
		Stream:     d.cfg.NATS.Stream,
		Owner:      "rewards-team",
		Workers:    2,
		AckWait:    5 * time.Second,
		EventTypes: []string{rewardEvent},
	}, h, consumer.WithLogger(d.log), consumer.WithRegisterer(reg), consumer.WithAfterCommit(h.afterCommit))
	if err != nil {
		return err
	}
	cctx, stop := context.WithCancel(ctx)
	defer stop()
	g, gctx := errgroup.WithContext(cctx)
	g.Go(func() error { return c.Run(gctx) })
	err = d.rewardFlow(gctx, pool, reg, h, evs, seqs, players)
	stop()
	if werr := g.Wait(); werr != nil {
		return fmt.Errorf("reward consumer: %w", werr)
	}
	return err
}

func (d *demo) rewardFlow(ctx context.Context, pool *pgxpool.Pool, reg *prometheus.Registry, h *rewardHandler,
	evs []confirmedEvent, seqs []uint64, players map[string]string) error {
	timeout := time.NewTimer(d.opts.wait)
	defer timeout.Stop()
	for range evs {
		select {
		case c := <-h.applied:
			d.out.detail("registration %s confirmed: player %s credited %d points", short(c.registration), short(c.player), rewardPoints)
		case <-ctx.Done():
			return ctx.Err()
		case <-timeout.C:
			return fmt.Errorf("%w: the reward consumer did not apply every event within %s", errMissingEvents, d.opts.wait)
		}
	}

	// The duplicate: the first event again, under a new Nats-Msg-Id so
	// that the stream stores it, as it would when the relay re-sends an
	// event after a crash and more than duplicate_window later.
	dup := evs[0]
	stream, err := d.js.Stream(ctx, d.cfg.NATS.Stream)
	if err != nil {
		return err
	}
	orig, err := stream.GetMsg(ctx, seqs[0])
	if err != nil {
		return fmt.Errorf("read event %s back from the stream: %w", dup.EventID, err)
	}
	subject := orig.Subject
	if t := stream.CachedInfo().Config.SubjectTransform; t != nil {
		subject = contract.PublishedSubject(t.Source, subject) // a partitioned stream's stored form
	}
	msg := &nats.Msg{Subject: subject, Header: nats.Header{}, Data: orig.Data}
	for k, v := range orig.Header {
		msg.Header[k] = append([]string(nil), v...)
	}
	msg.Header.Set(contract.MsgID, dup.EventID+"-redelivered")
	ack, err := d.js.PublishMsg(ctx, msg)
	if err != nil {
		return fmt.Errorf("publish the duplicate: %w", err)
	}
	d.republished++
	d.out.detail("re-published event %s (stream seq %d) as seq %d: a duplicate past JetStream's de-duplication window", short(dup.EventID), seqs[0], ack.Sequence)

	// Acknowledged means handled: applied, or recognised as a duplicate.
	cons, err := d.js.Consumer(ctx, d.cfg.NATS.Stream, rewardConsumer)
	if err != nil {
		return err
	}
	handled := poll(ctx, d.opts.wait, func() bool {
		info, err := cons.Info(ctx)
		return err == nil && info.AckFloor.Stream >= ack.Sequence
	})
	if err := ctx.Err(); err != nil {
		return err
	}
	if !handled {
		return fmt.Errorf("the reward consumer did not acknowledge the duplicate (seq %d) within %s", ack.Sequence, d.opts.wait)
	}
	select {
	case c := <-h.applied:
		return fmt.Errorf("the duplicate of event %s was applied again for player %s", dup.EventID, c.player)
	default:
	}
	hits := metricSum(reg, "outbox_consumer_idempotency_hits_total")
	d.out.detail("event %s delivered again: found in consumed_message, acknowledged without calling the handler (idempotency hits: %.0f)", short(dup.EventID), hits)

	// Check the effect in the database, not only what the handler said.
	for _, ev := range evs {
		player := players[ev.RegistrationID]
		var points, rows int64
		if err := pool.QueryRow(ctx, `SELECT points FROM reward_account WHERE player_id = $1`, player).Scan(&points); err != nil {
			return err
		}
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM consumed_message WHERE event_id = $1 AND consumer IN ($2, $3)`, ev.EventID, rewardConsumer, rewardLedger).Scan(&rows); err != nil {
			return err
		}
		if points != rewardPoints {
			return fmt.Errorf("player %s has %d points, want %d: event %s was not applied exactly once", player, points, rewardPoints, ev.EventID)
		}
		note := ""
		if ev.EventID == dup.EventID {
			note = ", delivered twice"
		}
		d.out.detail("player %s credited %d points (applied once%s; %d dedup rows: the library's and apply_reward_event's)", short(player), points, note, rows)
	}
	if hits != 1 {
		return fmt.Errorf("idempotency hits = %.0f, want 1", hits)
	}
	return nil
}

// metricSum sums a counter or gauge family of the registry (0 when absent).
func metricSum(reg *prometheus.Registry, name string) float64 {
	mfs, err := reg.Gather()
	if err != nil {
		return 0
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			sum += m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
	}
	return sum
}
