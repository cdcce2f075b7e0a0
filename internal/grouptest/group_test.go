package grouptest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	neturl "net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/consumer"
	"github.com/outbox-relay/outbox-relay/internal/opstest"
	"github.com/outbox-relay/outbox-relay/internal/provision"
	"github.com/outbox-relay/outbox-relay/internal/relaytest"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

func TestMain(m *testing.M) {
	if os.Getenv(envMember) != "" {
		os.Exit(memberMain())
	}
	os.Exit(testenv.Main(m))
}

const group = "grp"

// scenario is a relay publishing to a partitioned stream and the member
// processes of one group consuming it into the same database.
type scenario struct {
	t          *testing.T
	f          *opstest.Fixture
	partitions int // of the members started next
	pinnedTTL  string
	noVersion  bool          // members run without VersionCheck
	env        []string      // more environment of the members started next
	pause      time.Duration // chaos: the load's pause between transactions, when set
	natsURL    string
	pgURL      string

	mu      sync.Mutex
	members map[string]*member
}

type member struct {
	id     string
	cmd    *exec.Cmd
	out    *bytes.Buffer
	mu     *sync.Mutex
	err    chan error
	exited bool // kill or stop saw it exit
}

func newScenario(t *testing.T, partitions int) *scenario {
	t.Helper()
	if testing.Short() {
		t.Skip("runs OS processes over a 20,000-event load (skipped with -short)")
	}
	env := testenv.Get(t)
	f := opstest.New(t, "", 0)
	f.Cfg.Stream.Subjects = []string{f.Prefix + ".*.*"}
	f.Cfg.Stream.Partitions = partitions
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	f.Setup(ctx)
	f.CreateStreams(ctx)
	f.DB.ExecFile(t, filepath.Join(testenv.RepoRoot(t), "sql", "consumer.sql"))
	exec1(t, f, `CREATE TABLE applied (
		consumer text NOT NULL, event_id text NOT NULL, aggregate_id text NOT NULL,
		version bigint NOT NULL, member text NOT NULL, subject text NOT NULL, seq bigint NOT NULL,
		deliveries bigint NOT NULL, stored timestamptz NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp(), n bigserial PRIMARY KEY)`)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = f.JS.DeleteKeyValue(ctx, consumer.GroupBucket(group))
	})
	return &scenario{t: t, f: f, partitions: partitions, natsURL: env.NATS.URL, pgURL: f.DB.URL, members: map[string]*member{}}
}

func exec1(t *testing.T, f *opstest.Fixture, sql string, args ...any) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := f.DB.Pool.Exec(ctx, sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

func (s *scenario) count(sql string, args ...any) int64 {
	s.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var n int64
	if err := s.f.DB.Pool.QueryRow(ctx, sql, args...).Scan(&n); err != nil {
		s.t.Fatalf("%s: %v", sql, err)
	}
	return n
}

func (s *scenario) applied() int64 { return s.count(`SELECT count(*) FROM applied`) }

// start runs a member process with id; pgURL overrides the database URL.
func (s *scenario) start(id, pgURL string) {
	s.t.Helper()
	s.startVia(id, pgURL, "")
}

// startVia is start with natsURL overriding the NATS URL as well.
func (s *scenario) startVia(id, pgURL, natsURL string) {
	s.t.Helper()
	if pgURL == "" {
		pgURL = s.pgURL
	}
	if natsURL == "" {
		natsURL = s.natsURL
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(append(os.Environ(), s.env...),
		envMember+"="+id, envPostgres+"="+pgURL, envNATS+"="+natsURL,
		envStream+"="+s.f.Stream, envPartitions+"="+fmt.Sprint(s.partitions), envName+"="+group, envPinnedTTL+"="+s.pinnedTTL, envNoVersion+"="+map[bool]string{true: "1"}[s.noVersion])
	m := &member{id: id, cmd: cmd, out: &bytes.Buffer{}, mu: &sync.Mutex{}, err: make(chan error, 1)}
	cmd.Stdout = lockedWriter{m}
	cmd.Stderr = lockedWriter{m}
	if dir := os.Getenv(envLogDir); dir != "" {
		// Also to a file: a run killed by its timeout prints no output.
		name := strings.ReplaceAll(s.t.Name(), "/", "_") + "-" + id + "-" + strconv.FormatInt(time.Now().UnixNano(), 36) + ".log"
		if lf, err := os.Create(filepath.Join(dir, name)); err == nil {
			s.t.Cleanup(func() { _ = lf.Close() })
			cmd.Stdout, cmd.Stderr = io.MultiWriter(lockedWriter{m}, lf), io.MultiWriter(lockedWriter{m}, lf)
		}
	}
	if err := cmd.Start(); err != nil {
		s.t.Fatal(err)
	}
	go func() { m.err <- cmd.Wait() }()
	s.mu.Lock()
	s.members[id] = m
	s.mu.Unlock()
	s.t.Cleanup(func() {
		_ = cmd.Process.Kill()
		if s.t.Failed() {
			m.mu.Lock()
			s.t.Logf("member %s output:\n%s", id, tail(m.out.String(), 6000))
			m.mu.Unlock()
		}
	})
}

type lockedWriter struct{ m *member }

func (w lockedWriter) Write(p []byte) (int, error) {
	w.m.mu.Lock()
	defer w.m.mu.Unlock()
	return w.m.out.Write(p)
}

func tail(s string, n int) string {
	if len(s) > n {
		return "…" + s[len(s)-n:]
	}
	return s
}

// kill SIGKILLs a member and waits for it to be gone.
func (s *scenario) kill(id string) {
	s.t.Helper()
	m := s.members[id]
	_ = m.cmd.Process.Signal(syscall.SIGKILL)
	<-m.err
	m.exited = true
}

// signal sends sig to a member (SIGSTOP, SIGCONT).
func (s *scenario) signal(id string, sig syscall.Signal) {
	s.t.Helper()
	if err := s.members[id].cmd.Process.Signal(sig); err != nil {
		s.t.Fatalf("signal %v to member %s: %v", sig, id, err)
	}
}

// stop SIGTERMs a member; it must exit cleanly.
func (s *scenario) stop(id string) {
	s.t.Helper()
	m := s.members[id]
	if m.exited {
		return
	}
	m.exited = true
	_ = m.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-m.err:
		if err != nil {
			s.t.Errorf("member %s exited with %v", id, err)
		}
	case <-time.After(60 * time.Second):
		s.t.Errorf("member %s did not stop within 60s", id)
	}
}

// pins returns each partition's pinned client id ("" when none).
func (s *scenario) pins(partitions int) []string {
	s.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	out := make([]string, partitions)
	for p := range partitions {
		c, err := s.f.JS.Consumer(ctx, s.f.Stream, consumer.PartitionDurable(group, partitions, p))
		if err != nil {
			continue
		}
		info, err := c.Info(ctx)
		if err != nil {
			continue
		}
		for _, pg := range info.PriorityGroups {
			out[p] = pg.PinnedClientID
		}
	}
	return out
}

// ownedBy returns the partitions member id owns among the sorted ids.
func ownedBy(ids []string, id string, partitions int) []int {
	slices.Sort(ids)
	i := slices.Index(ids, id)
	var out []int
	for p := i; p < partitions; p += len(ids) {
		out = append(out, p)
	}
	return out
}

// waitSettled waits until every partition durable of partitions has
// nothing pending or unacknowledged.
func (s *scenario) waitSettled(partitions int, timeout time.Duration) {
	s.t.Helper()
	if !testenv.WaitFor(timeout, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		for p := range partitions {
			c, err := s.f.JS.Consumer(ctx, s.f.Stream, consumer.PartitionDurable(group, partitions, p))
			if err != nil {
				return false
			}
			info, err := c.Info(ctx)
			if err != nil || info.NumPending > 0 || info.NumAckPending > 0 {
				return false
			}
		}
		return true
	}) {
		s.t.Fatalf("partitions not settled within %s", timeout)
	}
}

// check verifies the database against the written events: every event
// applied exactly once, each aggregate's application order (the serial
// column) equal to its version order, no dead letters.
func (s *scenario) check(written []relaytest.Event) {
	s.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	rows := make([][]any, len(written))
	for i, e := range written {
		rows[i] = []any{e.ID, e.Aggregate, e.Version}
	}
	conn, err := s.f.DB.Pool.Acquire(ctx)
	testenv.Must(s.t, err, "acquire")
	defer conn.Release()
	_, err = conn.Exec(ctx, `CREATE TEMP TABLE written (event_id text PRIMARY KEY, aggregate_id text, version bigint)`)
	testenv.Must(s.t, err, "temp table")
	_, err = conn.CopyFrom(ctx, pgx.Identifier{"written"}, []string{"event_id", "aggregate_id", "version"}, pgx.CopyFromRows(rows))
	testenv.Must(s.t, err, "copy written")
	q := func(sql string) int64 {
		var n int64
		if err := conn.QueryRow(ctx, sql).Scan(&n); err != nil {
			s.t.Fatalf("%s: %v", sql, err)
		}
		return n
	}
	missing := q(`SELECT count(*) FROM written w WHERE NOT EXISTS (SELECT 1 FROM applied a WHERE a.event_id = w.event_id)`)
	twice := q(`SELECT count(*) FROM (SELECT event_id FROM applied GROUP BY event_id HAVING count(*) > 1) d`)
	extra := q(`SELECT count(*) FROM applied a WHERE NOT EXISTS (SELECT 1 FROM written w WHERE w.event_id = a.event_id)`)
	disorder := q(`SELECT count(*) FROM (
		SELECT version, row_number() OVER (PARTITION BY aggregate_id ORDER BY n) AS pos FROM applied) o
		WHERE version <> pos`)
	dead := q(`SELECT count(*) FROM consumer_dead_letter`)
	s.t.Logf("database: %d written, %d applied rows; missing %d, applied twice %d, unknown %d, out of version order %d, dead letters %d",
		len(written), q(`SELECT count(*) FROM applied`), missing, twice, extra, disorder, dead)
	if missing+twice+extra+disorder+dead != 0 {
		s.t.Errorf("group broke exactly-once in-order application")
	}
	if disorder > 0 {
		rows, err := conn.Query(ctx, `
			WITH o AS (SELECT aggregate_id, version, member, subject, seq, deliveries, at, n, row_number() OVER (PARTITION BY aggregate_id ORDER BY n) AS pos FROM applied),
			bad AS (SELECT aggregate_id FROM o WHERE version <> pos LIMIT 2)
			SELECT aggregate_id, version, pos, member || ' ' || subject || ' seq ' || seq || ' delivery ' || deliveries || ' at ' || to_char(at, 'HH24:MI:SS.MS'), n FROM o WHERE aggregate_id IN (SELECT aggregate_id FROM bad) ORDER BY aggregate_id, n`)
		testenv.Must(s.t, err, "disorder detail")
		for rows.Next() {
			var agg, m string
			var v, pos, n int64
			_ = rows.Scan(&agg, &v, &pos, &m, &n)
			if v != pos {
				s.t.Logf("  %s version %d applied as #%d by %s (serial %d)", agg, v, pos, m, n)
			}
		}
		rows.Close()
	}
	perMember, err := conn.Query(ctx, `SELECT member, count(*) FROM applied GROUP BY member ORDER BY member`)
	testenv.Must(s.t, err, "per member")
	for perMember.Next() {
		var m string
		var n int64
		_ = perMember.Scan(&m, &n)
		s.t.Logf("member %s applied %d", m, n)
	}
	perMember.Close()
}

// load returns the test's load: modest for CI, larger with OUTBOX_CHAOS=1.
func load() relaytest.Load {
	if os.Getenv("OUTBOX_CHAOS") == "1" {
		return relaytest.Load{Events: 200_000, Aggregates: 2_000, Writers: 4, BigTx: 100, Pause: 2 * time.Millisecond}
	}
	return relaytest.Load{Events: 20_000, Aggregates: 500, Writers: 4, BigTx: 100, Pause: 15 * time.Millisecond}
}

// TestGroupProcessesKillAndJoin: three member processes share an
// 8-partition stream fed by the relay; one is SIGKILLed mid-load and
// restarted, a fourth joins later. Every event is applied once, in
// version order per aggregate, nothing dead-lettered.
//
// Without VersionCheck nothing in the database guards the order: it rests
// on the hand-off and on PinnedTTL covering AckWait + RetryMax.
func TestGroupProcessesKillAndJoin(t *testing.T) {
	t.Run("VersionCheck", func(t *testing.T) { testKillAndJoin(t, false) })
	t.Run("NoVersionCheck", func(t *testing.T) { testKillAndJoin(t, true) })
}

func testKillAndJoin(t *testing.T, noVersion bool) {
	const partitions = 8
	s := newScenario(t, partitions)
	s.noVersion = noVersion
	ctx := runCtx(t)
	_, stopRelay := s.f.Start(ctx)
	defer func() { _ = stopRelay() }()
	ids := []string{"m1", "m2", "m3"}
	for _, id := range ids {
		s.start(id, "")
	}
	l := load()
	wait := relaytest.WriteAsync(ctx, t, s.f.DB.Pool, l)

	// Kill m1 once a quarter is applied and all three have partitions.
	s.waitProgress("events applied", int64(l.Events/4), 2*time.Minute, s.applied)
	victim := ownedBy(slices.Clone(ids), "m1", partitions)
	before := s.pins(partitions)
	s.kill("m1")
	killed := time.Now()
	var stored time.Time
	if !waitEvery(2*time.Minute, 250*time.Millisecond, func() (ok bool) {
		stored, ok = s.consumedSince(victim, partitions, "m1", killed)
		return ok
	}) {
		t.Fatalf("m1's partitions %v not consumed by the others within 2m", victim)
	}
	consumed := time.Since(killed)
	if !waitEvery(2*time.Minute, 250*time.Millisecond, func() bool {
		now := s.pins(partitions)
		for _, p := range victim {
			if now[p] == "" || now[p] == before[p] {
				return false
			}
		}
		return true
	}) {
		t.Fatalf("m1's partitions %v not taken over within 2m: pins %v (before %v)", victim, s.pins(partitions), before)
	}
	takeover := time.Since(killed)
	t.Logf("TAKEOVER: partitions %v of the SIGKILLed member: reassigned by a live member %.1fs, consumed again %.1fs (%s), re-pinned %.1fs after the kill (member TTL 3s)",
		victim, s.reassignedAt("m1", killed).Sub(killed).Seconds(), consumed.Seconds(), arrived(stored, killed), takeover.Seconds())
	s.start("m1", "") // restarted
	s.waitProgress("events applied", int64(l.Events*3/5), 2*time.Minute, s.applied)
	s.start("m4", "") // joins late
	written := wait()
	s.waitStored(ctx, len(written))
	s.waitApplied(len(written))
	s.waitSettled(partitions, time.Minute)
	for _, id := range []string{"m1", "m2", "m3", "m4"} {
		s.stop(id)
	}
	s.check(written)
}

// ackFloors returns each partition durable's ack floor (stream sequence).
func (s *scenario) ackFloors(partitions int) []uint64 {
	s.t.Helper()
	out := make([]uint64, partitions)
	for p := range partitions {
		// Each read retried to its own deadline: beside CPU hogs the NATS
		// server in this test process answered six reads under one 5 s
		// deadline too late (a CI run failed on it, not on the partitions).
		var last error
		if !testenv.WaitFor(30*time.Second, func() bool {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			c, err := s.f.JS.Consumer(ctx, s.f.Stream, consumer.PartitionDurable(group, partitions, p))
			if err != nil {
				last = err
				return false
			}
			info, err := c.Info(ctx)
			if err != nil {
				last = err
				return false
			}
			out[p] = info.AckFloor.Stream
			return true
		}) {
			s.t.Fatalf("partition %d info: %v", p, last)
		}
	}
	return out
}

// TestGroupPartitionCountChangeDuringLoad changes the stream from 4 to 8
// partitions while members consume a load, as `outbox-relay setup` with a
// new nats.partitions does; a member restarted with the new count joins.
// The old partitions drain first and are removed; nothing is reordered or
// applied twice.
//
// The members run without VersionCheck, so that only the drain-first rule
// keeps each aggregate's order across the change.
func TestGroupPartitionCountChangeDuringLoad(t *testing.T) {
	s := newScenario(t, 4)
	s.noVersion = true
	ctx := runCtx(t)
	_, stopRelay := s.f.Start(ctx)
	defer func() { _ = stopRelay() }()
	for _, id := range []string{"m1", "m2", "m3"} {
		s.start(id, "")
	}
	l := load()
	wait := relaytest.WriteAsync(ctx, t, s.f.DB.Pool, l)
	s.waitProgress("events applied", int64(l.Events/4), 2*time.Minute, s.applied)
	spec := s.f.Cfg.Stream
	spec.Partitions, spec.UpdatePartitions = 8, true
	rep, err := provision.EnsureStream(ctx, s.f.JS, spec, true)
	if err != nil || !rep.Partitioned {
		t.Fatalf("change the partition count: %+v, %v", rep, err)
	}
	changed := time.Now()
	t.Logf("partition count changed 4 -> 8 with %d of the load applied", s.applied())
	// A member restarted now must use the new count.
	s.stop("m3")
	s.partitions = 8
	s.start("m3", "")
	written := wait()
	s.waitStored(ctx, len(written))
	s.waitApplied(len(written))
	s.waitSettled(8, time.Minute)
	if !testenv.WaitFor(30*time.Second, func() bool {
		lctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		_, err := s.f.JS.Consumer(lctx, s.f.Stream, consumer.PartitionDurable(group, 4, 0))
		return errors.Is(err, jetstream.ErrConsumerNotFound)
	}) {
		t.Errorf("the 4-partition durables were not removed after draining")
	}
	t.Logf("new partitions drained the load %.1fs after the change", time.Since(changed).Seconds())
	for _, id := range []string{"m1", "m2", "m3"} {
		s.stop(id)
	}
	s.check(written)
}

// TestGroupMemberDatabaseUnreachable cuts one member off its database for
// 10 s (a stalled TCP proxy): its partitions do not advance meanwhile, the
// others do, and afterwards everything is applied once, in order.
func TestGroupMemberDatabaseUnreachable(t *testing.T) {
	const partitions = 6
	s := newScenario(t, partitions)
	// The stalled member keeps its partitions for the outage: PinnedTTL
	// above it (a member stalled longer than PinnedTTL loses them).
	s.pinnedTTL = "30s"
	ctx := runCtx(t)
	_, stopRelay := s.f.Start(ctx)
	defer func() { _ = stopRelay() }()
	env := testenv.Get(t)
	proxy, err := testenv.StartProxy(fmt.Sprintf("127.0.0.1:%d", env.PG.Port()))
	testenv.Must(t, err, "proxy")
	t.Cleanup(proxy.Close)
	ids := []string{"m1", "m2", "m3"}
	s.start("m1", "")
	s.start("m2", "")
	s.start("m3", withPort(s.pgURL, proxy.Port()))
	l := load()
	l.Pause = 250 * time.Millisecond // the load (~25 s) lasts through the outage
	wait := relaytest.WriteAsync(ctx, t, s.f.DB.Pool, l)
	s.waitProgress("events applied", int64(l.Events/10), 2*time.Minute, s.applied)
	stalled := ownedBy(slices.Clone(ids), "m3", partitions)
	proxy.Stall(testenv.Both)
	time.Sleep(2 * time.Second) // let in-flight transactions fail
	before := s.ackFloors(partitions)
	time.Sleep(8 * time.Second)
	after := s.ackFloors(partitions)
	proxy.Heal()
	for p := range partitions {
		moved := after[p] != before[p]
		if slices.Contains(stalled, p) && moved {
			t.Errorf("partition %d of the member without database advanced from %d to %d", p, before[p], after[p])
		}
		if !slices.Contains(stalled, p) && !moved {
			t.Logf("partition %d of a healthy member did not advance during the outage (%d)", p, after[p])
		}
	}
	t.Logf("during the outage: ack floors %v -> %v (stalled partitions %v)", before, after, stalled)
	written := wait()
	s.waitStored(ctx, len(written))
	s.waitApplied(len(written))
	s.waitSettled(partitions, time.Minute)
	for _, id := range ids {
		s.stop(id)
	}
	s.check(written)
}

func withPort(url string, port int) string {
	u, err := neturl.Parse(url)
	if err != nil {
		return url
	}
	u.Host = fmt.Sprintf("127.0.0.1:%d", port)
	return u.String()
}
