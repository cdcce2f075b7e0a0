package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/relaytest"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/replication"
)

func TestMain(m *testing.M) { os.Exit(testenv.Main(m)) }

// procFixture runs the real binary as a separate process, so tests can kill
// it with SIGKILL or stop it with SIGTERM.
type procFixture struct {
	t       *testing.T
	bin     string
	db      *testenv.Database
	cfgFile string
	logFile string
	js      jetstream.JetStream
	stream  string
	slot    string
}

func newProcFixture(t *testing.T) *procFixture {
	t.Helper()
	env := testenv.Get(t)
	db := env.NewDatabase(t)
	db.ExecFile(t, filepath.Join(testenv.RepoRoot(t), "sql", "outbox.sql"))
	name := testenv.UniqueName("p")
	stream := strings.ToUpper(name)
	dir := t.TempDir()
	cfg := fmt.Sprintf(`postgres:
  url: %s
  slot: %s
  publication: %s
  status_interval: 200ms
nats:
  url: %s
  stream: %s
  dead_letter_stream: %s_DLQ
  ack_timeout: 2s
tables:
  - table: public.outbox
    subject: "%s.{aggregate_type}.{aggregate_id}"
dead_letter_subject: %s_dlq
http:
  listen: ""
log:
  level: info
`, db.URL, name, name, env.NATS.URL, stream, stream, name, name)
	f := &procFixture{t: t, db: db, cfgFile: filepath.Join(dir, "config.yaml"), logFile: filepath.Join(dir, "relay.log"), stream: stream, slot: name}
	if err := os.WriteFile(f.cfgFile, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	// The slot must exist before the load starts: rows committed before it
	// are outside the stream (backfill is a separate path).
	if _, err := replication.Setup(context.Background(), replication.Config{URL: db.URL, Slot: name, Publication: name, Tables: []string{"public.outbox"}}); err != nil {
		t.Fatal(err)
	}
	f.bin = testenv.BuildBinary(t, "./cmd/outbox-relay")
	nc, err := nats.Connect(env.NATS.URL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	f.js, _ = jetstream.New(nc)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = f.js.DeleteStream(ctx, stream)
		_ = f.js.DeleteStream(ctx, stream+"_DLQ")
		if t.Failed() {
			b, _ := os.ReadFile(f.logFile)
			if len(b) > 20000 {
				b = b[len(b)-20000:]
			}
			t.Logf("relay log (tail):\n%s", b)
		}
	})
	return f
}

func (f *procFixture) start() *exec.Cmd {
	f.t.Helper()
	logf, err := os.OpenFile(f.logFile, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
	if err != nil {
		f.t.Fatal(err)
	}
	cmd := exec.Command(f.bin, "run", "--config", f.cfgFile)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		f.t.Fatal(err)
	}
	logf.Close()
	f.t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	})
	return cmd
}

func (f *procFixture) waitAll(ctx context.Context, evs []relaytest.Event, timeout time.Duration) relaytest.Report {
	f.t.Helper()
	relaytest.StoredPayloads(ctx, f.t, f.db.Pool, "outbox", evs)
	var n uint64
	if !testenv.WaitFor(timeout, func() bool {
		n = relaytest.StreamCount(ctx, f.js, f.stream)
		return n >= uint64(len(evs))
	}) {
		f.t.Logf("stream holds %d of %d events after %s", n, len(evs), timeout)
	}
	return relaytest.Check(evs, relaytest.ReadStream(ctx, f.t, f.js, f.stream))
}

// Acceptance 4: the relay is killed with SIGKILL at random moments during a
// 20,000-event load, five times: nothing missing, nothing out of order, no
// duplicate in the stream.
func TestKill9DuringLoad(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newProcFixture(t)
	cmd := f.start()

	writes := relaytest.WriteAsync(ctx, t, f.db.Pool, relaytest.Load{Events: 20000, Aggregates: 500, Writers: 4, BigTx: 100, BigEvery: 5, Pause: time.Millisecond})
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 1))
	for i := 0; i < 5; i++ {
		time.Sleep(time.Duration(300+rng.IntN(1200)) * time.Millisecond)
		if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		_ = cmd.Wait()
		t.Logf("kill %d: stream holds %d events", i+1, relaytest.StreamCount(ctx, f.js, f.stream))
		cmd = f.start()
	}
	evs := writes()
	rep := f.waitAll(ctx, evs, 90*time.Second)
	t.Logf("after 5 kills: %s", rep)
	if !rep.OK() || rep.Received != 20000 {
		t.Fatalf("guarantees broken: %s", rep)
	}
}

// Acceptance 5: SIGTERM during load exits 0 within 5 s; after a restart
// nothing is missing.
func TestSIGTERMDuringLoad(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newProcFixture(t)
	cmd := f.start()
	writes := relaytest.WriteAsync(ctx, t, f.db.Pool, relaytest.Load{Events: 5000, Aggregates: 100, Writers: 2, BigTx: 50, Pause: time.Millisecond})
	if !testenv.WaitFor(30*time.Second, func() bool { return relaytest.StreamCount(ctx, f.js, f.stream) > 100 }) {
		t.Fatal("relay did not start publishing")
	}
	start := time.Now()
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("relay exited with %v after SIGTERM, want status 0", err)
		}
		t.Logf("exited 0 after %s", time.Since(start).Round(time.Millisecond))
	case <-time.After(5 * time.Second):
		t.Fatal("relay did not exit within 5s of SIGTERM")
	}
	// The final status update confirmed what was acked.
	st, err := replication.Status(ctx, f.db.URL, f.slot)
	if err != nil || st.ConfirmedFlushLSN == 0 {
		t.Fatalf("slot after shutdown: %+v, %v", st, err)
	}
	evs := writes()
	f.start()
	rep := f.waitAll(ctx, evs, 60*time.Second)
	if !rep.OK() {
		t.Fatalf("after restart: %s", rep)
	}
}
