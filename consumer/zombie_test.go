package consumer

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/zap/zaptest"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// openZombie opens a session of the consumer's role that writes the dedup
// row of event id for consumer name in a transaction it leaves open, as an
// attempt whose client gave up while the server kept its transaction.
func openZombie(ctx context.Context, url, name, id string) (*pgx.Conn, error) {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return nil, fmt.Errorf("connect zombie: %w", err)
	}
	if _, err := conn.Exec(ctx, `BEGIN`); err != nil {
		conn.Close(ctx)
		return nil, fmt.Errorf("zombie begin: %w", err)
	}
	if _, err := conn.Exec(ctx, `INSERT INTO consumed_message (consumer, event_id, outcome) VALUES ($1, $2, 'applied')`, name, id); err != nil {
		conn.Close(ctx)
		return nil, fmt.Errorf("zombie insert: %w", err)
	}
	return conn, nil
}

// hookedDB is a database whose transactions a markingHandler marks with
// the event it applied; the commit of a marked transaction is onCommit's,
// and Begin fails with beginErr's error when it returns one.
type hookedDB struct {
	*pgxpool.Pool
	beginErr func() error
	onCommit func(ctx context.Context, tx pgx.Tx, event string) error
}

func (d *hookedDB) Begin(ctx context.Context) (pgx.Tx, error) {
	if d.beginErr != nil {
		if err := d.beginErr(); err != nil {
			return nil, err
		}
	}
	tx, err := d.Pool.Begin(ctx)
	if err != nil {
		return nil, err
	}
	return &hookedTx{Tx: tx, db: d}, nil
}

type hookedTx struct {
	pgx.Tx
	db    *hookedDB
	event string // set by markingHandler
}

func (t *hookedTx) Commit(ctx context.Context) error {
	if t.event == "" {
		return t.Tx.Commit(ctx)
	}
	return t.db.onCommit(ctx, t.Tx, t.event)
}

// markingHandler records applications and marks the transaction with the
// event for hookedDB.
type markingHandler struct{ *recorder }

func (h markingHandler) Handle(ctx context.Context, tx pgx.Tx, m *Message) error {
	if ht, ok := tx.(*hookedTx); ok {
		ht.event = m.ID
	}
	return h.recorder.Handle(ctx, tx, m)
}

// errLostAnswer is a commit whose answer was lost.
var errLostAnswer = fmt.Errorf("commit: %w", errors.New("unexpected EOF"))

// zombieAtCommit makes the first marked commit roll back instead and
// report an error, as a lost connection does, after a zombie took the
// event's dedup row: the commit probe then waits for the zombie.
func (f *fixture) zombieAtCommit(name string, zombies chan<- *pgx.Conn) *hookedDB {
	var once atomic.Bool
	return &hookedDB{Pool: f.pool, onCommit: func(ctx context.Context, tx pgx.Tx, event string) error {
		if !once.CompareAndSwap(false, true) {
			return tx.Commit(ctx)
		}
		if err := tx.Rollback(ctx); err != nil {
			return err
		}
		z, err := openZombie(ctx, f.db.URL, name, event)
		if err != nil {
			return err
		}
		zombies <- z
		return errLostAnswer
	}}
}

// A zombie of the consumer's role holds a message's dedup row: every
// attempt's dedup insert waits for it until HandlerTimeout. With one
// unknown and one transient attempt allowed, charging that wait
// dead-letters an event nothing is wrong with. The consumer must end the
// zombie, retry the message uncharged and apply it once. In "dedup insert"
// the zombie is there before the first delivery; in "commit probe" it
// takes the row after a commit that failed, so that the commit probe waits
// for it first.
func TestZombieTransactionNeitherChargesNorDeadLetters(t *testing.T) {
	t.Parallel()
	for _, tc := range []zombieCase{
		{name: "dedup insert", consumer: "zombieinsert"},
		{name: "commit probe", consumer: "zombieprobe", atCommit: true},
		{name: "dedup insert, a role without superuser", consumer: "zombierole", plainRole: true},
		{name: "dedup insert, in a batch", consumer: "zombiebatch", batch: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			zombieNeitherCharges(t, tc)
		})
	}
}

// zombieCase: where the zombie comes from, whether the consumer and the
// zombie log in as a role without superuser, and whether the message comes
// in a batch with three neighbours.
type zombieCase struct {
	name, consumer             string
	atCommit, plainRole, batch bool
}

// plainRole creates a login role without superuser that may use the
// fixture's tables, dropped when the test ends, and returns its URL and a
// pool logged in as it.
func (f *fixture) plainRole() (string, *pgxpool.Pool) {
	f.t.Helper()
	role := strings.ToLower(testenv.UniqueName("consumer_role"))
	mustExec(f.t, f.pool, fmt.Sprintf(`CREATE ROLE %s LOGIN NOSUPERUSER`, role))
	mustExec(f.t, f.pool, fmt.Sprintf(`GRANT ALL ON ALL TABLES IN SCHEMA public TO %s`, role))
	mustExec(f.t, f.pool, fmt.Sprintf(`GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO %s`, role))
	f.t.Cleanup(func() {
		ctx := context.Background()
		_, _ = f.pool.Exec(ctx, fmt.Sprintf(`DROP OWNED BY %s`, role))
		_, _ = f.pool.Exec(ctx, fmt.Sprintf(`DROP ROLE %s`, role))
	})
	u, err := url.Parse(f.db.URL)
	testenv.Must(f.t, err, "parse database URL")
	u.User = url.User(role)
	pool, err := pgxpool.New(context.Background(), u.String())
	testenv.Must(f.t, err, "open pool as %s", role)
	f.t.Cleanup(pool.Close)
	return u.String(), pool
}

func zombieNeitherCharges(t *testing.T, tc zombieCase) {
	f := newFixture(t)
	name, atCommit := tc.consumer, tc.atCommit
	cfg := f.baseConfig(name)
	cfg.HandlerTimeout = time.Second
	cfg.MaxAttempts, cfg.TransientAttempts = 1, 1
	e := event{ID: uuidN(1), AggID: "z", Version: 1}
	evs := []event{e}
	if tc.batch {
		cfg.Workers, cfg.BatchSize = 1, 8
		for i := 2; i <= 4; i++ {
			evs = append(evs, event{ID: uuidN(i), AggID: fmt.Sprintf("n%d", i), Version: 1})
		}
	}
	ctx := context.Background()
	dbURL, pool := f.db.URL, f.pool
	if tc.plainRole {
		dbURL, pool = f.plainRole()
	}
	zombies := make(chan *pgx.Conn, 1)
	var db DB = pool
	if atCommit {
		db = f.zombieAtCommit(name, zombies)
	} else {
		z, err := openZombie(ctx, dbURL, name, e.ID)
		testenv.Must(t, err, "open zombie")
		zombies <- z
	}
	r := newRecorder(name)
	c, err := New(db, f.js, cfg, markingHandler{r}, WithLogger(zaptest.NewLogger(t)), WithRegisterer(f.reg))
	testenv.Must(t, err, "new consumer")
	f.publish(evs...) // queued before the run starts: one batch
	f.run(c)
	var z *pgx.Conn
	select {
	case z = <-zombies:
		t.Cleanup(func() { z.Close(context.Background()) })
	case <-time.After(20 * time.Second):
		t.Fatalf("no zombie was made: the handler never committed")
	}
	f.waitFor("the event applied", 30*time.Second, func() bool {
		return queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE consumer = $1 AND event_id = $2`, name, e.ID) > 0 ||
			queryInt(t, f.pool, `SELECT count(*) FROM consumer_dead_letter WHERE consumer = $1`, name) > 0
	})
	var reason string
	if err := f.pool.QueryRow(ctx, `SELECT reason FROM consumer_dead_letter WHERE consumer = $1`, name).Scan(&reason); err == nil {
		t.Fatalf("dead-lettered: %s", reason)
	}
	f.waitSettled(name, 15*time.Second)
	if n := queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE consumer = $1`, name); n != int64(len(evs)) {
		t.Fatalf("%d effects of %d events, want one each", n, len(evs))
	}
	if n := queryInt(t, f.pool, `SELECT count(*) FROM consumed_message WHERE consumer = $1 AND content_hash IS NOT NULL`, name); n != int64(len(evs)) {
		t.Fatalf("%d dedup rows of the consumer's own, want %d", n, len(evs))
	}
	if got := metricValue(t, mustVec(t, f).retries.WithLabelValues(name, string(ClassUnknown))); got != 0 {
		t.Fatalf("%v unknown retries charged for the zombie's wait, want 0", got)
	}
	if _, err := z.Exec(ctx, `SELECT 1`); err == nil {
		t.Fatalf("the zombie's session is still alive")
	}
}

// unreachableAfterCommit makes the first marked commit go through on the
// server but report a lost connection, after which new transactions cannot
// begin for down: the commit probe cannot answer, and the retry's Begin
// fails too. Plain statements (the dead-letter insert) get through, as they
// do when the database comes back between two attempts. lied reports
// whether it did.
func (f *fixture) unreachableAfterCommit(down time.Duration) (db *hookedDB, lied func() bool) {
	var once atomic.Bool
	var until atomic.Int64 // unix nanoseconds
	return &hookedDB{
		Pool: f.pool,
		beginErr: func() error {
			if time.Now().UnixNano() < until.Load() {
				return Transient(errors.New("dial tcp: connection refused"))
			}
			return nil
		},
		onCommit: func(ctx context.Context, tx pgx.Tx, _ string) error {
			if err := tx.Commit(ctx); err != nil || !once.CompareAndSwap(false, true) {
				return err
			}
			until.Store(time.Now().Add(down).UnixNano())
			return errLostAnswer
		},
	}, once.Load
}

// The commit reaches the server and commits there, the answer is lost, and
// the database is unreachable for a moment: the commit probe cannot answer
// (unknown, retried uncharged), and the retry fails to begin, its one
// allowed transient attempt. The dead letter that follows would record an
// event that is applied: a message whose own dedup row is committed is
// acknowledged as a duplicate instead, never dead-lettered.
func TestZombieCommitNotDeadLettered(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	cfg := f.baseConfig("lostanswer")
	cfg.HandlerTimeout = time.Second
	cfg.MaxAttempts, cfg.TransientAttempts = 1, 1
	db, lied := f.unreachableAfterCommit(cfg.HandlerTimeout + 3*time.Second)
	r := newRecorder("lostanswer")
	c, err := New(db, f.js, cfg, markingHandler{r}, WithLogger(zaptest.NewLogger(t)), WithRegisterer(f.reg))
	testenv.Must(t, err, "new consumer")
	f.run(c)
	e := event{ID: uuidN(1), AggID: "la", Version: 1}
	f.publish(e)
	f.waitSettled("lostanswer", 30*time.Second)
	if !lied() {
		t.Fatalf("the commit's answer was never lost")
	}
	var reason string
	if err := f.pool.QueryRow(context.Background(), `SELECT reason FROM consumer_dead_letter WHERE consumer = 'lostanswer'`).Scan(&reason); err == nil {
		t.Fatalf("an applied event was dead-lettered: %s", reason)
	}
	if n := queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE consumer = 'lostanswer'`); n != 1 {
		t.Fatalf("applied %d times, want 1", n)
	}
	if n := r.callCount(e.ID); n != 1 {
		t.Fatalf("handler called %d times, want 1", n)
	}
}
