package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/internal/reward"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

func TestMain(m *testing.M) { os.Exit(testenv.Main(m)) }

const (
	player       = "aaaaaaaa-0000-4000-8000-000000000001"
	registration = "bbbbbbbb-0000-4000-8000-000000000001"
	unmapped     = "bbbbbbbb-0000-4000-8000-000000000002"
	eventID      = "0190a6e5-0000-7000-8000-000000000001"
)

type rig struct {
	t      *testing.T
	db     *testenv.Database
	js     jetstream.JetStream
	stream string
	nats   string
	bin    string
}

func newRig(t *testing.T) *rig {
	t.Helper()
	env := testenv.Get(t)
	db := env.NewDatabase(t)
	root := testenv.RepoRoot(t)
	db.ExecFile(t, filepath.Join(root, "sql", "consumer.sql"))
	db.ExecFile(t, filepath.Join(root, "sql", "reward.sql"))
	_, err := db.Pool.Exec(context.Background(), `INSERT INTO reward_account (player_id, points) VALUES ($1, 0)`, player)
	testenv.Must(t, err, "open reward account")
	_, err = db.Pool.Exec(context.Background(), `INSERT INTO reward_registration (registration_id, player_id) VALUES ($1, $2)`, registration, player)
	testenv.Must(t, err, "map registration to player")
	nc, err := nats.Connect(env.NATS.URL)
	testenv.Must(t, err, "nats")
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	testenv.Must(t, err, "jetstream")
	stream := testenv.UniqueName("OUTBOX")
	_, err = js.CreateStream(context.Background(), jetstream.StreamConfig{Name: stream, Subjects: []string{stream + ".>"}})
	testenv.Must(t, err, "stream")
	t.Cleanup(func() { _ = js.DeleteStream(context.Background(), stream) })
	return &rig{t: t, db: db, js: js, stream: stream, nats: env.NATS.URL, bin: testenv.BuildBinary(t, "./cmd/reward-consumer")}
}

// publish stores a RegistrationConfirmed event as the relay publishes it;
// msgID differs per copy so that the stream keeps every copy.
func (r *rig) publish(id, reg string, version int64, msgID string) {
	r.t.Helper()
	m := nats.NewMsg(r.stream + ".outbox." + reg)
	m.Header.Set(contract.MsgID, msgID)
	m.Header.Set(contract.EventID, id)
	m.Header.Set(contract.EventType, reward.EventType)
	m.Header.Set(contract.AggregateType, "outbox")
	m.Header.Set(contract.AggregateID, reg)
	m.Header.Set(contract.AggregateVersion, strconv.FormatInt(version, 10))
	m.Header.Set(contract.CommitTime, time.Now().UTC().Format(time.RFC3339Nano))
	m.Data = fmt.Appendf(nil, `{"version": %d, "registrationId": %q}`, version, reg)
	if _, err := r.js.PublishMsg(context.Background(), m); err != nil {
		r.t.Fatal(err)
	}
}

// start runs the binary; extraEnv adds environment variables.
func (r *rig) start(extraEnv ...string) *exec.Cmd {
	r.t.Helper()
	return r.startWith(nil, extraEnv...)
}

// startWith runs the binary with extra flags.
func (r *rig) startWith(flags []string, extraEnv ...string) *exec.Cmd {
	r.t.Helper()
	args := append([]string{"--postgres-url", r.db.URL, "--nats-url", r.nats, "--stream", r.stream,
		"--consumer", "rewards", "--points", "10", "--ack-wait", "2s", "--log-level", "warn"}, flags...)
	cmd := exec.Command(r.bin, args...)
	cmd.Env = append(os.Environ(), extraEnv...)
	logf, err := os.Create(filepath.Join(r.t.TempDir(), "consumer.log"))
	testenv.Must(r.t, err, "log file")
	cmd.Stdout, cmd.Stderr = logf, logf
	testenv.Must(r.t, cmd.Start(), "start reward-consumer")
	r.t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
		logf.Close()
		if r.t.Failed() {
			b, _ := os.ReadFile(logf.Name())
			r.t.Logf("reward-consumer log:\n%s", b)
		}
	})
	return cmd
}

func (r *rig) queryInt(sql string, args ...any) int64 {
	r.t.Helper()
	var n int64
	testenv.Must(r.t, r.db.Pool.QueryRow(context.Background(), sql, args...).Scan(&n), "%s", sql)
	return n
}

func (r *rig) waitSettled() {
	r.t.Helper()
	ok := testenv.WaitFor(30*time.Second, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		c, err := r.js.Consumer(ctx, r.stream, "rewards")
		if err != nil {
			return false
		}
		info, err := c.Info(ctx)
		if err != nil {
			return false
		}
		s, err := r.js.Stream(ctx, r.stream)
		if err != nil {
			return false
		}
		sinfo, err := s.Info(ctx)
		return err == nil && info.AckFloor.Stream >= sinfo.State.LastSeq && info.NumPending == 0 && info.NumAckPending == 0
	})
	if !ok {
		r.t.Fatal("consumer did not settle")
	}
}

// Acceptance 1: the same event delivered three times, and redelivered after
// the process is killed between commit and ack, credits points once.
func TestCrashBetweenCommitAndAckCreditsOnce(t *testing.T) {
	if testing.Short() {
		t.Skip("fault test")
	}
	t.Parallel()
	r := newRig(t)
	r.publish(eventID, registration, 2, eventID)

	marker := filepath.Join(t.TempDir(), "committed")
	crashing := r.start("REWARD_CONSUMER_TEST_CRASH_AFTER_COMMIT=" + marker)
	if !testenv.WaitFor(30*time.Second, func() bool { _, err := os.Stat(marker); return err == nil }) {
		t.Fatal("the consumer never committed")
	}
	if p := r.queryInt(`SELECT points FROM reward_account WHERE player_id = $1`, player); p != 10 {
		t.Fatalf("after the commit: %d points, want 10", p)
	}
	// The transaction committed; the ack was never sent.
	testenv.Must(t, crashing.Process.Signal(syscall.SIGKILL), "kill -9")
	_ = crashing.Wait()

	// Two more deliveries of the same event (a relay republishing it).
	r.publish(eventID, registration, 2, eventID+"/copy-1")
	r.publish(eventID, registration, 2, eventID+"/copy-2")
	// And one whose registration has no player: a permanent failure.
	r.publish("0190a6e5-0000-7000-8000-000000000002", unmapped, 2, "other")

	restarted := r.start()
	r.waitSettled()
	if p := r.queryInt(`SELECT points FROM reward_account WHERE player_id = $1`, player); p != 10 {
		t.Fatalf("%d points after a crash and 3 deliveries, want 10", p)
	}
	if n := r.queryInt(`SELECT count(*) FROM consumed_message WHERE event_id = $1`, eventID); n != 2 {
		t.Fatalf("%d dedup rows, want 2 (the library's and the ledger's)", n)
	}
	var reason string
	testenv.Must(t, r.db.Pool.QueryRow(context.Background(), `SELECT reason FROM consumer_dead_letter
		WHERE consumer = 'rewards' AND failure_class = 'permanent' AND aggregate_id = $1`, unmapped).Scan(&reason), "dead letter")
	if !strings.Contains(reason, "has no player in reward_registration") {
		t.Fatalf("dead letter reason %q", reason)
	}

	testenv.Must(t, restarted.Process.Signal(syscall.SIGTERM), "SIGTERM")
	if err := restarted.Wait(); err != nil {
		t.Fatalf("reward-consumer exited with %v after SIGTERM, want 0", err)
	}
}

// A batch size of 0 is refused, naming the fix.
func TestBatchSizeZeroRefused(t *testing.T) {
	bin := testenv.BuildBinary(t, "./cmd/reward-consumer")
	out, err := exec.Command(bin, "--postgres-url", "postgres://x@127.0.0.1:1/x", "--batch-size", "0").CombinedOutput()
	if err == nil || !strings.Contains(string(out), "--batch-size 0: want 1") {
		t.Fatalf("--batch-size 0: %v\n%s", err, out)
	}
}

// --help prints the flags and exits 0 (it exited 1, as for an error).
func TestHelpExitsZero(t *testing.T) {
	bin := testenv.BuildBinary(t, "./cmd/reward-consumer")
	out, err := exec.Command(bin, "--help").CombinedOutput()
	if err != nil {
		t.Fatalf("--help: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), "-postgres-url") || strings.Contains(string(out), "help requested") {
		t.Errorf("--help printed:\n%s", out)
	}
}

// Three copies of the binary with --group-partitions share a partitioned
// stream; one is SIGKILLed halfway and the others take its partitions
// over: every registration is credited once.
func TestThreeCopiesShareAStreamAsAGroup(t *testing.T) {
	if testing.Short() {
		t.Skip("fault test")
	}
	t.Parallel()
	r := newRig(t)
	ctx := context.Background()
	// A stream partitioned as `outbox-relay setup` with nats.partitions 6
	// makes it.
	r.stream = testenv.UniqueName("GROUP")
	src := r.stream + ".*.*"
	dst, err := contract.PartitionTransform(src, 6)
	testenv.Must(t, err, "transform")
	_, err = r.js.CreateStream(ctx, jetstream.StreamConfig{Name: r.stream, Subjects: []string{src},
		SubjectTransform: &jetstream.SubjectTransformConfig{Source: src, Destination: dst}})
	testenv.Must(t, err, "stream")
	t.Cleanup(func() {
		_ = r.js.DeleteStream(context.Background(), r.stream)
		_ = r.js.DeleteKeyValue(context.Background(), "OUTBOX_GROUP_rewards")
	})
	const n = 40
	regs := make([]string, n)
	for i := range regs {
		regs[i] = fmt.Sprintf("cccccccc-0000-4000-8000-%012d", i)
		p := fmt.Sprintf("dddddddd-0000-4000-8000-%012d", i)
		_, err := r.db.Pool.Exec(ctx, `INSERT INTO reward_account (player_id, points) VALUES ($1, 0)`, p)
		testenv.Must(t, err, "account")
		_, err = r.db.Pool.Exec(ctx, `INSERT INTO reward_registration (registration_id, player_id) VALUES ($1, $2)`, regs[i], p)
		testenv.Must(t, err, "registration")
	}
	var copies []*exec.Cmd
	for i := range 3 {
		copies = append(copies, r.startWith([]string{"--retry-max", "1s"}, "REWARD_CONSUMER_GROUP_PARTITIONS=6", fmt.Sprintf("REWARD_CONSUMER_GROUP_MEMBER=copy-%d", i)))
	}
	credited := func() int64 {
		return r.queryInt(`SELECT count(*) FROM reward_account WHERE player_id::text LIKE 'dddddddd%' AND points > 0`)
	}
	for i := range n / 2 {
		r.publish(fmt.Sprintf("0190a6e5-0000-7000-8001-%012d", i), regs[i], 2, fmt.Sprintf("g%d", i))
	}
	if !testenv.WaitFor(30*time.Second, func() bool { return credited() == n/2 }) {
		t.Fatalf("%d of %d credited by three copies", credited(), n/2)
	}
	testenv.Must(t, copies[0].Process.Signal(syscall.SIGKILL), "kill -9")
	_ = copies[0].Wait()
	for i := n / 2; i < n; i++ {
		r.publish(fmt.Sprintf("0190a6e5-0000-7000-8001-%012d", i), regs[i], 2, fmt.Sprintf("g%d", i))
	}
	if !testenv.WaitFor(60*time.Second, func() bool { return credited() == n }) {
		t.Fatalf("%d of %d credited after a copy was killed", credited(), n)
	}
	if p := r.queryInt(`SELECT count(*) FROM reward_account WHERE player_id::text LIKE 'dddddddd%' AND points <> 10`); p != 0 {
		t.Fatalf("%d players without exactly 10 points", p)
	}
	// A copy told to stop while it joins, before its first assignment,
	// stops as asked: exit 0 (it exited 1 with "context canceled").
	late := r.startWith([]string{"--log-level", "info"}, "REWARD_CONSUMER_GROUP_PARTITIONS=6", "REWARD_CONSUMER_GROUP_MEMBER=copy-late")
	lateLog := late.Stdout.(*os.File).Name()
	if !testenv.WaitFor(30*time.Second, func() bool {
		b, _ := os.ReadFile(lateLog)
		return strings.Contains(string(b), "consuming as a group member")
	}) {
		t.Fatal("the late copy did not start consuming as a group member in 30 s")
	}
	testenv.Must(t, late.Process.Signal(syscall.SIGTERM), "SIGTERM")
	if err := late.Wait(); err != nil {
		t.Fatalf("a copy stopped while joining exited with %v, want 0", err)
	}
	for _, c := range copies[1:] {
		testenv.Must(t, c.Process.Signal(syscall.SIGTERM), "SIGTERM")
		if err := c.Wait(); err != nil {
			t.Fatalf("a copy exited with %v after SIGTERM, want 0", err)
		}
	}
}
