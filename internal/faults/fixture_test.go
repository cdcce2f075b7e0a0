package faults

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.yaml.in/yaml/v3"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/replication"
)

// scenario is one fault test's world: a database with the outbox table, a
// slot and publication, stream names, a connection for the test's own
// reads, and the relay's YAML configuration as a tree the test edits
// before it starts relay processes.
type scenario struct {
	t       *testing.T
	pg      *testenv.Postgres
	db      *testenv.Database
	natsURL string // what the test itself connects to (never through a proxy)
	nc      *nats.Conn
	js      jetstream.JetStream
	name    string // lower-case unique name: slot, publication, subject prefix
	stream  string
	dlq     string
	dir     string
	cfg     map[string]any
	natsOpt []nats.Option

	mu      sync.Mutex
	relays  []*relayProc
	sampler *lsnSampler
	begun   time.Time
}

// logf logs with the time since the scenario began, so a slow step shows.
func (s *scenario) logf(format string, args ...any) {
	s.t.Helper()
	s.t.Logf("[%6.2fs] %s", time.Since(s.begun).Seconds(), fmt.Sprintf(format, args...))
}

// newScenario prepares a database on pg, the slot and the publication, and
// a relay configuration that publishes to natsURL. Extra client options
// (credentials, TLS) are for the test's own connection.
func newScenario(t *testing.T, pg *testenv.Postgres, natsURL string, natsOpts ...nats.Option) *scenario {
	t.Helper()
	begun := time.Now()
	db := testenv.NewDatabaseOn(t, pg)
	db.ExecFile(t, filepath.Join(testenv.RepoRoot(t), "sql", "outbox.sql"))
	name := testenv.UniqueName("f")
	s := &scenario{
		t: t, pg: pg, db: db, natsURL: natsURL, name: name,
		stream: strings.ToUpper(name), dlq: strings.ToUpper(name) + "_DLQ",
		dir: t.TempDir(), natsOpt: natsOpts, begun: begun,
	}
	s.cfg = map[string]any{
		"postgres": map[string]any{
			"url":             db.URL,
			"slot":            name,
			"publication":     name,
			"status_interval": "200ms",
		},
		"nats": map[string]any{
			"url":                natsURL,
			"stream":             s.stream,
			"dead_letter_stream": s.dlq,
			"ack_timeout":        "2s",
		},
		"tables":              []any{map[string]any{"table": "public.outbox", "subject": name + ".{aggregate_type}.{aggregate_id}"}},
		"dead_letter_subject": name + "_dlq",
		"http":                map[string]any{"listen": ""},
		"log":                 map[string]any{"level": "info"},
	}
	// The slot exists before any load starts: rows committed before it are
	// outside the relay's reach by design.
	if _, err := replication.Setup(context.Background(), replication.Config{URL: db.URL, Slot: name, Publication: name, Tables: []string{"public.outbox"}}); err != nil {
		t.Fatal(err)
	}
	opts := append([]nats.Option{nats.MaxReconnects(-1), nats.ReconnectWait(100 * time.Millisecond), nats.RetryOnFailedConnect(true)}, natsOpts...)
	nc, err := nats.Connect(natsURL, opts...)
	if err != nil {
		t.Fatal(err)
	}
	s.nc = nc
	s.js, err = jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		s.stopRelays()
		if s.sampler != nil {
			s.sampler.stop()
		}
		if t.Failed() {
			s.dumpLogs()
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = s.js.DeleteStream(ctx, s.stream)
		_ = s.js.DeleteStream(ctx, s.dlq)
		nc.Close()
	})
	return s
}

// set sets a configuration key by its dotted path, e.g.
// set("postgres.receive_timeout", "3s").
func (s *scenario) set(path string, v any) {
	m := s.cfg
	parts := strings.Split(path, ".")
	for _, p := range parts[:len(parts)-1] {
		sub, ok := m[p].(map[string]any)
		if !ok {
			sub = map[string]any{}
			m[p] = sub
		}
		m = sub
	}
	m[parts[len(parts)-1]] = v
}

// writeConfig writes the configuration to a new file and returns its path.
func (s *scenario) writeConfig() string {
	s.t.Helper()
	b, err := yaml.Marshal(s.cfg)
	if err != nil {
		s.t.Fatal(err)
	}
	f, err := os.CreateTemp(s.dir, "config-*.yaml")
	if err != nil {
		s.t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.Write(b); err != nil {
		s.t.Fatal(err)
	}
	return f.Name()
}

func (s *scenario) unset(path string) {
	m := s.cfg
	parts := strings.Split(path, ".")
	for _, p := range parts[:len(parts)-1] {
		sub, ok := m[p].(map[string]any)
		if !ok {
			return
		}
		m = sub
	}
	delete(m, parts[len(parts)-1])
}

// relayProc is one outbox-relay process.
type relayProc struct {
	t       *testing.T
	cmd     *exec.Cmd
	logFile string
	done    chan struct{}
	err     error // exit status, once done is closed
	started time.Time
}

var relayCount struct {
	mu sync.Mutex
	n  int
}

// startRelay runs `outbox-relay run` with the current configuration.
func (s *scenario) startRelay() *relayProc {
	s.t.Helper()
	return s.startCmd(nil, "run", "--config", s.writeConfig())
}

// startCmd starts the binary with args; env adds environment variables.
func (s *scenario) startCmd(env []string, args ...string) *relayProc {
	s.t.Helper()
	relayCount.mu.Lock()
	relayCount.n++
	n := relayCount.n
	relayCount.mu.Unlock()
	r := &relayProc{t: s.t, logFile: filepath.Join(s.dir, fmt.Sprintf("relay-%d.log", n)), done: make(chan struct{})}
	f, err := os.Create(r.logFile)
	if err != nil {
		s.t.Fatal(err)
	}
	r.cmd = exec.Command(relayBinary(s.t), args...)
	r.cmd.Stdout, r.cmd.Stderr = f, f
	r.cmd.Env = append(os.Environ(), env...)
	if err := r.cmd.Start(); err != nil {
		f.Close()
		s.t.Fatal(err)
	}
	f.Close()
	r.started = time.Now()
	go func() {
		r.err = r.cmd.Wait()
		close(r.done)
	}()
	s.mu.Lock()
	s.relays = append(s.relays, r)
	s.mu.Unlock()
	return r
}

var (
	binOnce sync.Once
	binPath string
)

func relayBinary(t *testing.T) string {
	binOnce.Do(func() { binPath = testenv.BuildBinary(t, "./cmd/outbox-relay") })
	if binPath == "" {
		t.Fatal("outbox-relay binary was not built")
	}
	return binPath
}

// kill sends SIGKILL and waits for the process to go.
func (r *relayProc) kill() {
	if r.running() {
		_ = r.cmd.Process.Signal(syscall.SIGKILL)
	}
	<-r.done
}

// term sends SIGTERM and waits up to timeout for a clean exit.
func (r *relayProc) term(timeout time.Duration) error {
	if r.running() {
		_ = r.cmd.Process.Signal(syscall.SIGTERM)
	}
	select {
	case <-r.done:
		return r.err
	case <-time.After(timeout):
		r.kill()
		return fmt.Errorf("no exit within %s of SIGTERM", timeout)
	}
}

func (r *relayProc) running() bool {
	select {
	case <-r.done:
		return false
	default:
		return true
	}
}

// wait waits up to timeout for the process to exit on its own.
func (r *relayProc) wait(timeout time.Duration) (exited bool, err error) {
	select {
	case <-r.done:
		return true, r.err
	case <-time.After(timeout):
		return false, nil
	}
}

// output returns everything the process wrote.
func (r *relayProc) output() string {
	b, _ := os.ReadFile(r.logFile)
	return string(b)
}

func (s *scenario) stopRelays() {
	s.mu.Lock()
	rs := append([]*relayProc(nil), s.relays...)
	s.mu.Unlock()
	for _, r := range rs {
		r.kill()
	}
}

func (s *scenario) dumpLogs() {
	s.mu.Lock()
	rs := append([]*relayProc(nil), s.relays...)
	s.mu.Unlock()
	for i, r := range rs {
		out := r.output()
		if os.Getenv("OUTBOX_FAULTS_FULL_LOGS") == "" && len(out) > 12000 {
			out = "..." + out[len(out)-12000:]
		}
		s.t.Logf("relay process %d (%v) output:\n%s", i+1, r.cmd.Args[1:2], out)
	}
}

// runCmd runs the binary to completion (setup, status, teardown) and
// returns its combined output and exit code.
func (s *scenario) runCmd(timeout time.Duration, env []string, args ...string) (string, int) {
	s.t.Helper()
	r := s.startCmd(env, args...)
	exited, err := r.wait(timeout)
	if !exited {
		r.kill()
		s.t.Fatalf("outbox-relay %v did not finish within %s:\n%s", args, timeout, r.output())
	}
	code := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else if err != nil {
		s.t.Fatal(err)
	}
	return r.output(), code
}

// slot reads the slot's row through the harness's superuser.
func (s *scenario) slot(ctx context.Context) (replication.SlotStatus, error) {
	return replication.Status(ctx, s.pg.URL(s.db.Name), s.name)
}

// waitSlotActive waits until a relay streams from the slot and returns the
// walsender's pid.
func (s *scenario) waitSlotActive(timeout time.Duration) int32 {
	s.t.Helper()
	var pid int32
	if !testenv.WaitFor(timeout, func() bool {
		st, err := s.slot(context.Background())
		pid = st.ActivePID
		return err == nil && st.Active
	}) {
		s.t.Fatalf("no relay streams from slot %s after %s", s.name, timeout)
	}
	return pid
}

// streamInfo returns the stream's configuration and state, failing the
// test when it cannot.
func (s *scenario) streamInfo(ctx context.Context, stream string) *jetstream.StreamInfo {
	s.t.Helper()
	st, err := s.js.Stream(ctx, stream)
	if err != nil {
		s.t.Fatalf("stream %s: %v", stream, err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		s.t.Fatalf("stream %s: %v", stream, err)
	}
	return info
}

// streamState returns the stream's message count and last sequence (zeros
// when it is missing or unreachable).
func (s *scenario) streamState(ctx context.Context, stream string) (msgs, last uint64) {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	st, err := s.js.Stream(ctx, stream)
	if err != nil {
		return 0, 0
	}
	info, err := st.Info(ctx)
	if err != nil {
		return 0, 0
	}
	return info.State.Msgs, info.State.LastSeq
}

// lastCommitLSN returns the Outbox-Commit-LSN of the event stream's newest
// message (0 when there is none or it cannot be read).
func (s *scenario) lastCommitLSN(ctx context.Context) replication.LSN {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	st, err := s.js.Stream(ctx, s.stream)
	if err != nil {
		return 0
	}
	info, err := st.Info(ctx)
	if err != nil || info.State.LastSeq == 0 {
		return 0
	}
	m, err := st.GetMsg(ctx, info.State.LastSeq)
	if err != nil {
		return 0
	}
	lsn, _ := replication.ParseLSN(m.Header.Get(contract.CommitLSN))
	return lsn
}

// waitProgress waits until the stream's last sequence passes from and
// returns how long that took.
func (s *scenario) waitProgress(from uint64, timeout time.Duration) time.Duration {
	s.t.Helper()
	start := time.Now()
	var last uint64
	if !testenv.WaitFor(timeout, func() bool {
		_, last = s.streamState(context.Background(), s.stream)
		return last > from
	}) {
		s.t.Fatalf("stream %s did not move past sequence %d within %s (last %d)", s.stream, from, timeout, last)
	}
	return time.Since(start)
}

// caughtUp waits until the slot confirms the WAL position of now: every
// transaction committed so far is relayed and acknowledged. It returns how
// long that took.
func (s *scenario) caughtUp(timeout time.Duration) (time.Duration, error) {
	ctx := context.Background()
	var txt string
	if err := s.db.Pool.QueryRow(ctx, "SELECT pg_current_wal_lsn()::text").Scan(&txt); err != nil {
		return 0, err
	}
	target, _ := replication.ParseLSN(txt)
	start := time.Now()
	var st replication.SlotStatus
	if !testenv.WaitFor(timeout, func() bool {
		var err error
		st, err = s.slot(ctx)
		return err == nil && st.ConfirmedFlushLSN >= target
	}) {
		return timeout, fmt.Errorf("the slot did not confirm %s within %s (confirmed %s): the relay is stuck", target, timeout, st.ConfirmedFlushLSN)
	}
	return time.Since(start), nil
}

// waitCount waits until the stream holds at least n messages.
func (s *scenario) waitCount(stream string, n uint64, timeout time.Duration) {
	s.t.Helper()
	var got uint64
	if !testenv.WaitFor(timeout, func() bool {
		got, _ = s.streamState(context.Background(), stream)
		return got >= n
	}) {
		s.t.Fatalf("stream %s holds %d messages after %s, want %d", stream, got, timeout, n)
	}
}

// withHostPort returns the connection URL u pointed at addr (host:port),
// e.g. at a proxy.
func withHostPort(u, addr string) string {
	pu, err := url.Parse(u)
	if err != nil {
		panic(err)
	}
	pu.Host = addr
	return pu.String()
}

// exec runs SQL as the harness's superuser in the scenario's database.
func (s *scenario) exec(ctx context.Context, sql string, args ...any) {
	s.t.Helper()
	if _, err := s.db.Pool.Exec(ctx, sql, args...); err != nil {
		s.t.Fatalf("%s: %v", sql, err)
	}
}

// adminConn connects to the scenario's database as the superuser, outside
// the pool (for role and grant set-up).
func (s *scenario) adminConn(ctx context.Context) *pgx.Conn {
	s.t.Helper()
	c, err := pgx.Connect(ctx, s.pg.URL(s.db.Name))
	if err != nil {
		s.t.Fatal(err)
	}
	s.t.Cleanup(func() { c.Close(context.Background()) })
	return c
}

func itoa(i int) string { return fmt.Sprint(i) }

// logEntry is one JSON log line of a relay process.
type logEntry struct {
	Level  string    `json:"level"`
	TS     time.Time `json:"-"`
	RawTS  string    `json:"ts"`
	Logger string    `json:"logger"`
	Msg    string    `json:"msg"`
	Error  string    `json:"error"`
}

// entries parses the process's JSON log lines (other lines are skipped).
func (r *relayProc) entries() []logEntry {
	var out []logEntry
	for _, line := range strings.Split(r.output(), "\n") {
		if !strings.HasPrefix(line, "{") {
			continue
		}
		var e logEntry
		if json.Unmarshal([]byte(line), &e) != nil {
			continue
		}
		e.TS, _ = time.Parse("2006-01-02T15:04:05.000Z0700", e.RawTS)
		out = append(out, e)
	}
	return out
}

// waitLog waits until the process logs an entry after since that match
// accepts, and returns the entry's time.
func (r *relayProc) waitLog(since time.Time, timeout time.Duration, match func(logEntry) bool) (time.Time, bool) {
	since = since.Truncate(time.Millisecond) // log times have milliseconds
	var at time.Time
	ok := testenv.WaitFor(timeout, func() bool {
		for _, e := range r.entries() {
			if !e.TS.Before(since) && match(e) {
				at = e.TS
				return true
			}
		}
		return false
	})
	return at, ok
}

// countLog counts entries logged after since that match accepts.
func (r *relayProc) countLog(since time.Time, match func(logEntry) bool) int {
	since = since.Truncate(time.Millisecond)
	n := 0
	for _, e := range r.entries() {
		if !e.TS.Before(since) && match(e) {
			n++
		}
	}
	return n
}
