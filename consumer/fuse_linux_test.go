//go:build linux

package consumer

import (
	"context"
	"fmt"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// The stubborn fuse must hold a commit through the cancel request pgx sends
// when it loses a connection, or TestCommitStillRunningIsNotJudgedAbsent
// tests nothing: the commit rolls back, and "absent" is the right answer.
// PostgreSQL 15's postmaster delivers one cancel request as two SIGINTs, to
// the backend and then to its process group (signal_child), and the second
// can arrive while the backend is still handling the first. A fuse that
// caught cancels in one block let 3 to 14 of these 64 pairs end the commit
// (gaps from 30 µs up; a 2-core box, idle or beside six busy loops), as in
// a CI failure of TestCommitStillRunningIsNotJudgedAbsent: the commit
// judged absent after 0.36 s. The test sends the pairs itself, to a backend
// of this host's test cluster.
func TestStubbornFuseOutlastsADoubledCancel(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.fuse()
	var through []string
	tries := 0
	for gap := time.Duration(0); gap <= 150*time.Microsecond; gap += 10 * time.Microsecond {
		for range 4 {
			tries++
			if err := f.doubleCancelInFuse(gap); err != nil {
				through = append(through, fmt.Sprintf("%s apart: %v", gap, err))
			}
		}
	}
	if len(through) > 0 {
		t.Fatalf("the fuse let %d of %d doubled cancels end the commit:\n%s", len(through), tries, strings.Join(through, "\n"))
	}
}

// doubleCancelInFuse commits a transaction that blows the stubborn fuse,
// signals its backend SIGINT twice, gap apart, once it waits in the fuse,
// and returns the commit's error if the commit ended within 100 ms after
// (it holds for two seconds otherwise; the backend is then terminated).
func (f *fixture) doubleCancelInFuse(gap time.Duration) error {
	f.t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, f.db.URL)
	testenv.Must(f.t, err, "connect")
	defer conn.Close(ctx)
	pid := int(conn.PgConn().PID())
	// Only a backend of this test's database on this host: with an
	// external server the number may name another process.
	if title, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid)); err != nil || !strings.Contains(string(title), " "+f.db.Name+" ") {
		f.t.Skipf("backend %d is not a process of this host (%v): the test signals it", pid, err)
	}
	tx, err := conn.Begin(ctx)
	testenv.Must(f.t, err, "begin")
	_, err = tx.Exec(ctx, `INSERT INTO commit_fuse VALUES ('stubborn')`)
	testenv.Must(f.t, err, "arm the fuse")
	done := make(chan error, 1)
	go func() { done <- tx.Commit(ctx) }()
	if !testenv.WaitFor(10*time.Second, func() bool {
		var n int
		err := f.pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND wait_event = 'PgSleep'`, pid).Scan(&n)
		return err == nil && n > 0
	}) {
		f.t.Fatalf("the commit was not seen waiting in the fuse")
	}
	testenv.Must(f.t, syscall.Kill(pid, syscall.SIGINT), "signal backend %d", pid)
	for start := time.Now(); time.Since(start) < gap; { // a timer does not keep microseconds
	}
	testenv.Must(f.t, syscall.Kill(pid, syscall.SIGINT), "signal backend %d", pid)
	select {
	case err := <-done:
		return fmt.Errorf("the commit ended: %v", err)
	case <-time.After(100 * time.Millisecond):
	}
	mustExec(f.t, f.pool, `SELECT pg_terminate_backend($1)`, pid)
	<-done
	return nil
}
