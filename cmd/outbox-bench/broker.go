package main

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"slices"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/internal/provision"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/router"
)

// brokerResult is the broker ceiling: what JetStream stores on this machine
// without PostgreSQL or the relay in the way.
type brokerResult struct {
	Messages    int     `json:"messages"`
	Window      int     `json:"window"`
	AvgBytes    float64 `json:"avg_message_bytes"` // payload + encoded headers
	Seconds     float64 `json:"seconds"`
	Rate        float64 `json:"msgs_per_sec"`
	Errors      int64   `json:"errors"`
	BenchCores  float64 `json:"client_and_server_cores"` // this process: client + embedded server
	SyncCount   int     `json:"sync_messages"`
	SyncP50ms   float64 `json:"sync_p50_ms"`
	SyncP99ms   float64 `json:"sync_p99_ms"`
	SyncRate    float64 `json:"sync_msgs_per_sec"`
	MachineCore float64 `json:"machine_cores"`
}

// outboxRelation is the relation pgoutput sends for sql/outbox.sql.
var outboxRelation = &replication.Relation{ID: 1, Namespace: "public", Name: "outbox", Columns: []replication.Column{
	{Name: "event_id"}, {Name: "aggregate_type"}, {Name: "aggregate_id"}, {Name: "aggregate_version"},
	{Name: "event_type"}, {Name: "payload"}, {Name: "occurred_at"}, {Name: "publish_state"},
}}

// benchPayload is the JSON text PostgreSQL stores for bench_load's row g
// (jsonb orders keys by length, then bytes).
func benchPayload(g int64, aggs, pad int) string {
	return fmt.Sprintf(`{"seq": %d, "note": "%s", "customer": "customer-%d", "amount_cents": %d}`,
		g, padding(pad), g%int64(aggs), (g*7919)%100000)
}

var padCache string

func padding(n int) string {
	if len(padCache) != n {
		b := make([]byte, n)
		for i := range b {
			b[i] = 'x'
		}
		padCache = string(b)
	}
	return padCache
}

// routedMessages builds n messages exactly as the relay would publish bench
// rows: the router renders subject, headers and payload from a decoded row.
func routedMessages(subjectPrefix string, first int64, n, aggs, pad int) ([]*nats.Msg, float64, error) {
	rt, err := router.New(router.Config{
		Tables:            []router.TableConfig{{Table: "public.outbox", Subject: subjectPrefix + ".{aggregate_type}.{aggregate_id}"}},
		DeadLetterSubject: subjectPrefix + "_dlq",
	})
	if err != nil {
		return nil, 0, err
	}
	commit := router.CommitInfo{LSN: 0x16B3748, Time: time.Now()}
	msgs := make([]*nats.Msg, n)
	var total int
	for i := range n {
		g := first + int64(i)
		vals := []string{uuid.NewString(), "order", fmt.Sprintf("agg-%d", g%int64(aggs)), fmt.Sprint(g/int64(aggs) + 1),
			"OrderPlaced", benchPayload(g, aggs, pad), "2026-01-02 03:04:05.123456+00", "PENDING"}
		ins := &replication.Insert{Relation: outboxRelation, LSN: replication.LSN(0x16B3748 + g*512)}
		for _, v := range vals {
			ins.Values = append(ins.Values, replication.Value{Kind: replication.ValueText, Data: []byte(v)})
		}
		m, err := rt.Route(ins, commit)
		if err != nil {
			return nil, 0, err
		}
		msgs[i] = &nats.Msg{Subject: m.Subject, Header: m.Header.NATS(), Data: m.Data}
		total += len(m.Data) + m.HeaderLen
	}
	return msgs, float64(total) / float64(n), nil
}

// freshStream creates the scenario's stream, configured as the relay's
// (file storage, R1, 2-minute de-duplication), and returns its subject
// prefix and a function that deletes it.
func freshStream(ctx context.Context, env *benchEnv, scenario string) (prefix string, drop func(), err error) {
	stream, prefix := streamNames(scenario)
	spec := provision.StreamSpec{Name: stream, Subjects: []string{prefix + ".>"}, Duplicates: 2 * time.Minute}
	if _, err := provision.EnsureStream(ctx, env.js, spec, true); err != nil {
		return "", nil, err
	}
	return prefix, func() { _ = env.js.DeleteStream(context.Background(), stream) }, nil
}

// brokerCeiling publishes n routed messages to a fresh file-storage stream
// with async publish and at most window unacknowledged, waiting for every
// ack; then syncN synchronous publishes for the round-trip floor.
//
// The async part runs repeat times; the best round counts.
func brokerCeiling(ctx context.Context, env *benchEnv, n, window, syncN, aggs, pad, repeat int) (brokerResult, error) {
	prefix, drop, err := freshStream(ctx, env, "broker")
	if err != nil {
		return brokerResult{}, err
	}
	defer drop()
	msgs, avg, err := routedMessages(prefix, 0, n+syncN, aggs, pad)
	if err != nil {
		return brokerResult{}, err
	}
	var errs atomic.Int64
	js, err := jetstream.New(env.nc,
		jetstream.WithPublishAsyncMaxPending(window),
		jetstream.WithPublishAsyncErrHandler(func(jetstream.JetStream, *nats.Msg, error) { errs.Add(1) }))
	if err != nil {
		return brokerResult{}, err
	}
	res := brokerResult{Messages: n, Window: window, AvgBytes: avg, SyncCount: syncN}
	// The same messages again are duplicates (same Nats-Msg-Id): each round
	// gets fresh ids so that the stream stores every message.
	for round := 0; round < max(1, repeat); round++ {
		if round > 0 {
			for i, m := range msgs[:n] {
				m.Header.Set(contract.MsgID, fmt.Sprintf("%s-r%d", m.Header.Get(contract.EventID), round))
				msgs[i] = m
			}
		}
		m0, c0 := readMachineCPU(), selfCPU()
		start := time.Now()
		for _, m := range msgs[:n] {
			if _, err := js.PublishMsgAsync(m); err != nil {
				return res, fmt.Errorf("publish async: %w", err)
			}
		}
		select {
		case <-js.PublishAsyncComplete():
		case <-time.After(5 * time.Minute):
			return res, fmt.Errorf("broker ceiling: acks missing after 5 minutes")
		case <-ctx.Done():
			return res, ctx.Err()
		}
		el := time.Since(start)
		if rate := float64(n) / el.Seconds(); rate > res.Rate {
			res.Seconds = el.Seconds()
			res.Rate = rate
			res.BenchCores = (selfCPU() - c0).Seconds() / el.Seconds()
			res.MachineCore = busyCores(m0, readMachineCPU())
		}
	}
	res.Errors = errs.Load()

	lat := make([]time.Duration, 0, syncN)
	start := time.Now()
	for _, m := range msgs[n:] {
		t := time.Now()
		if _, err := env.js.PublishMsg(ctx, m); err != nil {
			return res, fmt.Errorf("publish sync: %w", err)
		}
		lat = append(lat, time.Since(t))
	}
	if syncN > 0 {
		res.SyncRate = float64(syncN) / time.Since(start).Seconds()
		slices.Sort(lat)
		res.SyncP50ms = ms(percentile(lat, 0.50))
		res.SyncP99ms = ms(percentile(lat, 0.99))
	}
	return res, nil
}

// percentile returns the nearest-rank q-quantile of sorted.
func percentile(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(math.Ceil(q*float64(len(sorted)))) - 1
	return sorted[max(0, min(i, len(sorted)-1))]
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// brokerPaced is the broker alone at a steady offered load: the relay's
// messages published one by one on schedule (open loop), each timed from its
// publish to its ack, with no PostgreSQL and no relay. What JetStream adds to
// commit→ack at that load shows here, its own pauses included.
type brokerPaced struct {
	Offered      int       `json:"offered_per_sec"`
	PublishToAck quantiles `json:"publish_to_ack"`
	// Stalls are the stream sequences at which an ack took over 10 ms
	// after acks under 3 ms: pauses of the server, which recur at the same
	// sequences run after run.
	Stalls []int `json:"stall_seqs,omitempty"`
}

// brokerPacedRun publishes rate messages per second for warmup+dur to a
// fresh stream configured as the relay's; samples from the warm-up are
// dropped.
func brokerPacedRun(ctx context.Context, env *benchEnv, rate int, warmup, dur time.Duration, aggs, pad int) (brokerPaced, error) {
	res := brokerPaced{Offered: rate}
	prefix, drop, err := freshStream(ctx, env, "paced")
	if err != nil {
		return res, err
	}
	defer drop()
	total := int(float64(rate) * (warmup + dur).Seconds())
	msgs, _, err := routedMessages(prefix, 0, total, aggs, pad)
	if err != nil {
		return res, err
	}
	sent := make([]atomic.Int64, total)
	lat := make([]time.Duration, total)
	var acked, failed atomic.Int64
	done := make(chan struct{})
	inbox := env.nc.NewInbox() + "."
	sub, err := env.nc.Subscribe(inbox+"*", func(m *nats.Msg) {
		i, err := strconv.Atoi(m.Subject[len(inbox):])
		if err != nil || i < 0 || i >= total {
			return
		}
		lat[i] = time.Duration(time.Now().UnixNano() - sent[i].Load())
		if bytes.Contains(m.Data, []byte(`"error"`)) || len(m.Data) == 0 {
			failed.Add(1)
		}
		if acked.Add(1) == int64(total) {
			close(done)
		}
	})
	if err != nil {
		return res, err
	}
	defer func() { _ = sub.Unsubscribe() }()
	if err := sub.SetPendingLimits(-1, -1); err != nil {
		return res, err
	}
	t0 := time.Now().Add(50 * time.Millisecond)
	period := time.Second / time.Duration(rate)
	for i, m := range msgs {
		if d := time.Until(t0.Add(time.Duration(i) * period)); d > 0 {
			time.Sleep(d)
		}
		m.Reply = inbox + strconv.Itoa(i)
		sent[i].Store(time.Now().UnixNano())
		if err := env.nc.PublishMsg(m); err != nil {
			return res, fmt.Errorf("publish: %w", err)
		}
	}
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		return res, fmt.Errorf("%d of %d acks within 60s of the last publish", acked.Load(), total)
	case <-ctx.Done():
		return res, ctx.Err()
	}
	if n := failed.Load(); n > 0 {
		return res, fmt.Errorf("%d publishes failed", n)
	}
	from := int(float64(rate) * warmup.Seconds())
	bySeq := make(map[int]time.Duration, total-from)
	for i := from; i < total; i++ {
		bySeq[i+1] = lat[i] // a fresh stream: message i is sequence i+1
	}
	res.Stalls = stalls(bySeq)
	res.PublishToAck = quantilesOf(lat[from:])
	return res, nil
}
