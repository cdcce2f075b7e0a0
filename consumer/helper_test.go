package consumer

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap/zaptest"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

func TestMain(m *testing.M) { os.Exit(testenv.Main(m)) }

// fixture is one test's database, NATS connection and stream.
type fixture struct {
	t      *testing.T
	db     *testenv.Database
	pool   *pgxpool.Pool
	js     jetstream.JetStream
	stream string
	reg    *prometheus.Registry
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	env := testenv.Get(t)
	return newFixtureOn(t, env.NewDatabase(t), env.NATS.URL)
}

func newFixtureOn(t *testing.T, db *testenv.Database, natsURL string) *fixture {
	t.Helper()
	db.ExecFile(t, filepath.Join(testenv.RepoRoot(t), "sql", "consumer.sql"))
	db.ExecFile(t, filepath.Join(testenv.RepoRoot(t), "sql", "reward.sql"))
	mustExec(t, db.Pool, `CREATE TABLE applied (
		consumer text NOT NULL, event_id text NOT NULL, aggregate_id text NOT NULL,
		version bigint NOT NULL, n bigserial PRIMARY KEY)`)
	pcfg, err := pgxpool.ParseConfig(db.URL)
	testenv.Must(t, err, "parse pool config")
	pcfg.MaxConns = 12
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	testenv.Must(t, err, "open pool")
	t.Cleanup(pool.Close)
	nc, err := nats.Connect(natsURL, nats.MaxReconnects(-1))
	testenv.Must(t, err, "connect to nats")
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	testenv.Must(t, err, "jetstream")
	name := testenv.UniqueName("S")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{name + ".>"}, Storage: jetstream.MemoryStorage})
	testenv.Must(t, err, "create stream")
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = js.DeleteStream(ctx, name)
	})
	return &fixture{t: t, db: db, pool: pool, js: js, stream: name, reg: prometheus.NewRegistry()}
}

func mustExec(t testing.TB, db DB, sql string, args ...any) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := db.Exec(ctx, sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

func queryInt(t testing.TB, db DB, sql string, args ...any) int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var n int64
	if err := db.QueryRow(ctx, sql, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// event is a test event as the relay would publish it.
type event struct {
	ID      string
	Type    string
	AggType string
	AggID   string
	Version int64
	Payload string
	// MsgID overrides Nats-Msg-Id, so that the same event can be stored
	// twice (the relay republishing after the dedup window).
	MsgID string
}

func (e event) msg(stream string) *nats.Msg {
	aggType := e.AggType
	if aggType == "" {
		aggType = "registration"
	}
	typ := e.Type
	if typ == "" {
		typ = "RegistrationConfirmed"
	}
	payload := e.Payload
	if payload == "" {
		payload = fmt.Sprintf(`{"registrationId": %q, "version": %d}`, e.AggID, e.Version)
	}
	m := nats.NewMsg(stream + "." + aggType + "." + e.AggID)
	msgID := e.MsgID
	if msgID == "" {
		msgID = e.ID
	}
	m.Header.Set(contract.MsgID, msgID)
	m.Header.Set(contract.EventID, e.ID)
	m.Header.Set(contract.EventType, typ)
	m.Header.Set(contract.AggregateType, aggType)
	m.Header.Set(contract.AggregateID, e.AggID)
	m.Header.Set(contract.AggregateVersion, strconv.FormatInt(e.Version, 10))
	m.Header.Set(contract.CommitTime, time.Now().UTC().Format(time.RFC3339Nano))
	m.Header.Set(contract.CommitLSN, "0/16B3748")
	m.Header.Set(contract.Table, "public.outbox")
	m.Header.Set(contract.ContentType, contract.JSONContentType)
	m.Data = []byte(payload)
	return m
}

func (f *fixture) publish(evs ...event) {
	f.t.Helper()
	for _, e := range evs {
		// A deadline per message: 1,200 synchronous publishes under one
		// 10 s deadline did not fit beside six CPU hogs (load 30).
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		_, err := f.js.PublishMsg(ctx, e.msg(f.stream))
		cancel()
		if err != nil {
			f.t.Fatalf("publish %s: %v", e.ID, err)
		}
	}
}

// baseConfig is a fast-retrying configuration for tests.
func (f *fixture) baseConfig(name string) Config {
	return Config{
		Name:               name,
		Stream:             f.stream,
		Owner:              "team-rewards",
		Workers:            4,
		AckWait:            5 * time.Second,
		RetryBase:          20 * time.Millisecond,
		RetryMax:           200 * time.Millisecond,
		GapWait:            2 * time.Second,
		GapRecheck:         100 * time.Millisecond,
		ReplayPollInterval: 50 * time.Millisecond,
		StatsInterval:      100 * time.Millisecond,
	}
}

// start runs a consumer until the test ends.
func (f *fixture) start(cfg Config, h Handler, opts ...Option) *Consumer {
	f.t.Helper()
	return f.startOn(f.js, cfg, h, opts...)
}

// startOn runs a consumer on js (another connection than the fixture's)
// until the test ends.
func (f *fixture) startOn(js jetstream.JetStream, cfg Config, h Handler, opts ...Option) *Consumer {
	f.t.Helper()
	opts = append([]Option{WithLogger(zaptest.NewLogger(f.t)), WithRegisterer(f.reg)}, opts...)
	c, err := New(f.pool, js, cfg, h, opts...)
	testenv.Must(f.t, err, "new consumer")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	f.t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			f.t.Errorf("consumer %s: Run: %v", cfg.Name, err)
		}
	})
	return c
}

// recorder is a handler that inserts each application into the applied
// table, in the message's transaction, and counts its calls.
type recorder struct {
	name  string
	mu    sync.Mutex
	calls map[string]int
	// fail, when set, decides the handler's error for a message.
	fail func(m *Message, call int) error
}

func newRecorder(name string) *recorder { return &recorder{name: name, calls: map[string]int{}} }

func (r *recorder) Handle(ctx context.Context, tx pgx.Tx, m *Message) error {
	r.mu.Lock()
	r.calls[m.ID]++
	call := r.calls[m.ID]
	fail := r.fail
	r.mu.Unlock()
	if err := insertApplied(ctx, tx, r.name, m); err != nil {
		return err
	}
	if fail != nil {
		return fail(m, call)
	}
	return nil
}

// insertApplied records m's application by the consumer name in tx: the
// test handlers' effect.
func insertApplied(ctx context.Context, tx pgx.Tx, name string, m *Message) error {
	_, err := tx.Exec(ctx, `INSERT INTO applied (consumer, event_id, aggregate_id, version) VALUES ($1, $2, $3, $4)`,
		name, m.ID, m.AggregateID, m.AggregateVersion)
	return err
}

func (r *recorder) callCount(id string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.calls[id]
}

// waitSettled waits until the durable consumer has no pending or
// unacknowledged messages left.
func (f *fixture) waitSettled(name string, timeout time.Duration) {
	f.t.Helper()
	var last *jetstream.ConsumerInfo
	ok := testenv.WaitFor(timeout, func() bool {
		info, ok := f.consumerInfo(name)
		if !ok {
			return false
		}
		last = info
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		// The ack floor at the stream's last sequence means everything was
		// delivered and acknowledged (the counters alone can be read before
		// a just-created consumer has computed them).
		s, err := f.js.Stream(ctx, f.stream)
		if err != nil {
			return false
		}
		sinfo, err := s.Info(ctx)
		return err == nil && info.AckFloor.Stream >= sinfo.State.LastSeq &&
			info.NumPending == 0 && info.NumAckPending == 0 && info.NumRedelivered == 0
	})
	if !ok {
		f.t.Fatalf("consumer %s not settled within %s: %+v", name, timeout, last)
	}
}

// consumerInfo asks the server for the durable consumer's state.
func (f *fixture) consumerInfo(name string) (*jetstream.ConsumerInfo, bool) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	c, err := f.js.Consumer(ctx, f.stream, name)
	if err != nil {
		return nil, false
	}
	info, err := c.Info(ctx)
	return info, err == nil
}

func (f *fixture) waitFor(what string, timeout time.Duration, cond func() bool) {
	f.t.Helper()
	if !testenv.WaitFor(timeout, cond) {
		f.t.Fatalf("timed out after %s waiting for %s", timeout, what)
	}
}

func uuidN(n int) string { return fmt.Sprintf("00000000-0000-7000-8000-%012d", n) }
