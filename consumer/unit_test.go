package consumer

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/outbox-relay/outbox-relay/contract"
)

func TestBackoff(t *testing.T) {
	base, max := 100*time.Millisecond, 2*time.Second
	for _, tc := range []struct {
		attempt int
		rnd     float64
		want    time.Duration
	}{
		{1, 0, 50 * time.Millisecond},
		{1, 0.999999999, 100 * time.Millisecond},
		{2, 0, 100 * time.Millisecond},
		{3, 0.5, 300 * time.Millisecond},
		{5, 0, 800 * time.Millisecond},      // 1.6s step, lower half
		{6, 0, time.Second},                 // capped at 2s
		{100, 0.999999999, 2 * time.Second}, // no overflow
		{0, 0, 50 * time.Millisecond},
	} {
		got := backoff(tc.attempt, base, max, func() float64 { return tc.rnd })
		if d := got - tc.want; d > time.Millisecond || d < -time.Millisecond {
			t.Errorf("backoff(%d, rnd %v) = %s, want %s", tc.attempt, tc.rnd, got, tc.want)
		}
	}
}

func TestClassOf(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		want Class
	}{
		{"transient", Transient(errors.New("x")), ClassTransient},
		{"permanent", Permanent(errors.New("x")), ClassPermanent},
		{"reject", Reject("no"), ClassRejected},
		{"wrapped permanent", fmt.Errorf("ctx: %w", Permanent(errors.New("x"))), ClassPermanent},
		{"permanent wrapping a db outage", Permanent(&pgconn.ConnectError{}), ClassPermanent},
		{"plain", errors.New("x"), ClassUnknown},
		{"panic", &PanicError{Value: "x"}, ClassUnknown},
		{"deadline", context.DeadlineExceeded, ClassUnknown},
		{"connect error", &pgconn.ConnectError{}, ClassTransient},
		{"admin shutdown", &pgconn.PgError{Code: "57P01"}, ClassTransient},
		{"cannot connect now", &pgconn.PgError{Code: "57P03"}, ClassTransient},
		{"connection failure", &pgconn.PgError{Code: "08006"}, ClassTransient},
		{"too many connections", &pgconn.PgError{Code: "53300"}, ClassTransient},
		{"serialization", &pgconn.PgError{Code: "40001"}, ClassTransient},
		{"deadlock", &pgconn.PgError{Code: "40P01"}, ClassTransient},
		{"read-only transaction after a failover", &pgconn.PgError{Code: "25006"}, ClassTransient},
		{"unique violation", &pgconn.PgError{Code: "23505"}, ClassUnknown},
		{"raise exception", &pgconn.PgError{Code: "P0001"}, ClassUnknown},
		{"overflow", &pgconn.PgError{Code: "22003"}, ClassUnknown},
		{"unexpected eof", fmt.Errorf("read: %w", io.ErrUnexpectedEOF), ClassTransient},
		{"refused", &net.OpError{Op: "dial", Err: syscall.ECONNREFUSED}, ClassTransient},
		{"reset", fmt.Errorf("x: %w", syscall.ECONNRESET), ClassTransient},
	} {
		if got := ClassOf(tc.err); got != tc.want {
			t.Errorf("%s: ClassOf = %s, want %s", tc.name, got, tc.want)
		}
	}
	if Transient(nil) != nil || Permanent(nil) != nil {
		t.Error("Transient(nil) and Permanent(nil) must be nil")
	}
	var re *RejectError
	if !errors.As(Reject("sold out"), &re) || re.Reason != "sold out" {
		t.Error("Reject must carry its reason")
	}
	if !errors.Is(&PanicError{Value: 1}, ErrPanic) {
		t.Error("PanicError must match ErrPanic")
	}
}

func TestConfigValidation(t *testing.T) {
	ok := Config{Name: "c", Stream: "S"}
	for _, tc := range []struct {
		name string
		mod  func(*Config)
		ok   bool
	}{
		{"defaults", func(*Config) {}, true},
		{"no name", func(c *Config) { c.Name = "" }, false},
		{"no stream", func(c *Config) { c.Stream = "" }, false},
		{"version check with event types", func(c *Config) { c.VersionCheck = true; c.EventTypes = []string{"A"} }, false},
		{"handler timeout above ack wait", func(c *Config) { c.AckWait = 2 * time.Second; c.HandlerTimeout = 3 * time.Second }, false},
		{"ack wait too short", func(c *Config) { c.AckWait = time.Millisecond }, false},
		{"pending below workers", func(c *Config) { c.Workers = 8; c.MaxAckPending = 4 }, false},
		{"retry max below base", func(c *Config) { c.RetryBase = time.Second; c.RetryMax = time.Millisecond }, false},
		{"gap recheck above wait", func(c *Config) { c.GapWait = time.Second; c.GapRecheck = 2 * time.Second }, false},
		{"negative initial version", func(c *Config) { c.InitialVersion = -1 }, false},
		{"negative transient attempts", func(c *Config) { c.TransientAttempts = -1 }, false},
		{"gap wait below retry max + ack wait", func(c *Config) { c.VersionCheck = true; c.GapWait = 30 * time.Second }, false},
		{"gap wait of RetryMax + AckWait", func(c *Config) {
			c.VersionCheck = true
			c.AckWait, c.RetryMax, c.GapWait = time.Second, time.Second, 2*time.Second
		}, true},
		{"short gap wait without version check", func(c *Config) { c.GapWait = time.Second }, true},
		{"default gap wait follows a long ack wait", func(c *Config) { c.VersionCheck = true; c.AckWait = 2 * time.Minute }, true},
		{"batch size 1: one transaction per message", func(c *Config) { c.BatchSize = 1 }, true},
		{"negative batch size", func(c *Config) { c.BatchSize = -1 }, false},
	} {
		c := ok
		tc.mod(&c)
		c.setDefaults()
		err := c.validate()
		if (err == nil) != tc.ok || (err != nil && !errors.Is(err, ErrInvalidConfig)) {
			t.Errorf("%s: validate = %v, want ok=%v", tc.name, err, tc.ok)
		}
	}
	c := ok
	c.setDefaults()
	if c.BatchSize != DefaultBatchSize {
		t.Errorf("BatchSize left 0 became %d, want DefaultBatchSize", c.BatchSize)
	}
	c.BatchSize = -3
	if err := c.validate(); err == nil || !strings.Contains(err.Error(), "set 1 for one transaction per message") {
		t.Errorf("negative BatchSize: %v, want an error naming the fix", err)
	}
}

// TestContentHashIsStable pins ContentHash's bytes: they are stored in
// consumed_message and compared with every redelivery, so a change would
// turn every stored event's duplicate into a conflict. The values are the
// first implementation's (a hash.Hash written field by field), on both
// sides of the stack buffer's size.
func TestContentHashIsStable(t *testing.T) {
	for _, tc := range []struct {
		ev   contract.Event
		want string
	}{
		{contract.Event{Type: "order.placed", AggregateType: "order", AggregateID: "42", AggregateVersion: 7, Payload: []byte(`{"total":12}`)},
			"10d4f95d4b9a01e81c0cd4dca13ad9e927d9c7fcf7a61e254460a92570f8df67"},
		{contract.Event{AggregateVersion: -3},
			"8138e6e62a581964d8e532001018594e20dfc3a4a82fff49eb6db446f3df9786"},
		{contract.Event{Type: "t", AggregateType: "a", AggregateID: "x/y", AggregateVersion: 1 << 40, Payload: []byte(strings.Repeat("p", 5000))},
			"03caf5b3edbdeabc5980c44817dbed27abe360f09ac44f0afb05c896c05ec88c"},
	} {
		if got := hex.EncodeToString(ContentHash(&tc.ev)); got != tc.want {
			t.Errorf("ContentHash(%s/%s v%d, %d payload bytes) = %s, want %s", tc.ev.AggregateType, tc.ev.AggregateID, tc.ev.AggregateVersion, len(tc.ev.Payload), got, tc.want)
		}
	}
	// At the stack buffer's edge, both ways of hashing agree.
	for n := contentHashStack - contentHashFixed - 40; n < contentHashStack; n++ {
		ev := contract.Event{Type: "order.placed", AggregateType: "order", AggregateID: "42", AggregateVersion: 7, Payload: bytes.Repeat([]byte{'x'}, n)}
		if a, b := ContentHash(&ev), contentHashLarge(&ev); !bytes.Equal(a, b) {
			t.Fatalf("payload of %d bytes: %x on the stack, %x streamed", n, a, b)
		}
	}
	ev := contract.Event{Type: "order.placed", AggregateType: "order", AggregateID: "42", AggregateVersion: 7, Payload: bytes.Repeat([]byte{'x'}, 256)}
	if n := testing.AllocsPerRun(100, func() { ContentHash(&ev) }); n > 1 {
		t.Errorf("ContentHash of a 256-byte event: %.0f allocations, want the result's alone", n)
	}
}

func TestContentHashCoversIdentityAndPayload(t *testing.T) {
	base := contract.Event{ID: "id", Type: "T", AggregateType: "a", AggregateID: "1", AggregateVersion: 2, Payload: []byte(`{"x":1}`)}
	h := ContentHash(&base)
	if !bytes.Equal(h, ContentHash(&base)) {
		t.Fatal("hash is not deterministic")
	}
	other := base
	other.ID = "other id" // the id is the key, not part of the content
	if !bytes.Equal(h, ContentHash(&other)) {
		t.Fatal("hash depends on the event id")
	}
	for name, mod := range map[string]func(*contract.Event){
		"type":     func(e *contract.Event) { e.Type = "U" },
		"agg type": func(e *contract.Event) { e.AggregateType = "b" },
		"agg id":   func(e *contract.Event) { e.AggregateID = "2" },
		"version":  func(e *contract.Event) { e.AggregateVersion = 3 },
		"payload":  func(e *contract.Event) { e.Payload = []byte(`{"x":2}`) },
		"shifted":  func(e *contract.Event) { e.AggregateType, e.AggregateID = "a1", "" },
	} {
		e := base
		mod(&e)
		if bytes.Equal(h, ContentHash(&e)) {
			t.Errorf("%s change keeps the hash", name)
		}
	}
}

// A deadline while beginning the transaction was spent waiting for a
// connection: transient, unlike the handler's own deadline.
func TestFailedBeginClass(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		want Class
	}{
		{"deadline", context.DeadlineExceeded, ClassTransient},
		{"pool wait deadline", fmt.Errorf("acquire connection: %w", context.DeadlineExceeded), ClassTransient},
		{"cannot connect now", &pgconn.PgError{Code: "57P03"}, ClassTransient},
		{"read only", &pgconn.PgError{Code: "25006"}, ClassTransient},
		{"other", errors.New("odd"), ClassUnknown},
		{"cancelled", context.Canceled, ClassUnknown},
	} {
		if got := failedBegin(tc.err); got.kind != resFailed || got.class != tc.want {
			t.Errorf("%s: failedBegin = %v %s, want %s", tc.name, got.kind, got.class, tc.want)
		}
	}
}

// The labelled counters the alerts use are exported at 0 before their
// first increment.
func TestMetricsStartAtZero(t *testing.T) {
	reg := prometheus.NewRegistry()
	if _, err := newMetrics(reg, "svc", "team"); err != nil {
		t.Fatal(err)
	}
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	series := map[string]int{}
	for _, f := range fams {
		series[f.GetName()] = len(f.GetMetric())
	}
	if series["outbox_consumer_retries_total"] != 2 || series["outbox_consumer_dead_lettered_total"] != 5 {
		t.Errorf("series before any increment: retries %d, dead letters %d; want 2 and 5",
			series["outbox_consumer_retries_total"], series["outbox_consumer_dead_lettered_total"])
	}
}

// MaxAckPending's default: a batch in flight and three queued per worker,
// and never below DefaultMinMaxAckPending (a group member of three
// workers once defaulted to 768 and waited for its budget).
func TestMaxAckPendingDefault(t *testing.T) {
	for _, tc := range []struct {
		workers, batch, want int
	}{
		{0, 0, 4096},    // 8 workers x 4 x 64 = 2048, below the floor
		{3, 0, 4096},    // 768
		{24, 0, 6144},   // 24 x 256
		{8, 512, 16384}, // 8 x 4 x 512
		{2, 1, 4096},    // 2 x 64
	} {
		c := Config{Workers: tc.workers, BatchSize: tc.batch}
		c.setDefaults()
		if c.MaxAckPending != tc.want {
			t.Errorf("Workers %d, BatchSize %d: MaxAckPending %d, want %d", tc.workers, tc.batch, c.MaxAckPending, tc.want)
		}
	}
}

func BenchmarkContentHash(b *testing.B) {
	ev := contract.Event{Type: "order.placed", AggregateType: "order", AggregateID: "agg-417", AggregateVersion: 12, Payload: bytes.Repeat([]byte{'x'}, 256)}
	b.ReportAllocs()
	for b.Loop() {
		ContentHash(&ev)
	}
}
