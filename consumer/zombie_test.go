package consumer

import (
	"context"
	"errors"
	"fmt"
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

// zombieAtCommit is a database whose first commit of a transaction that
// applied an event (armed by the handler) rolls back instead and reports an
// error, as a lost connection does, after a zombie took the event's dedup
// row: the commit probe then waits for the zombie.
type zombieAtCommit struct {
	*pgxpool.Pool
	url, name string
	armed     atomic.Bool
	zombie    chan *pgx.Conn // the zombie, for the test to watch
}

func (d *zombieAtCommit) Begin(ctx context.Context) (pgx.Tx, error) {
	tx, err := d.Pool.Begin(ctx)
	if err != nil {
		return nil, err
	}
	return &zombieTx{Tx: tx, db: d}, nil
}

type zombieTx struct {
	pgx.Tx
	db    *zombieAtCommit
	event string // set by the handler
}

func (t *zombieTx) Commit(ctx context.Context) error {
	if t.event == "" || !t.db.armed.CompareAndSwap(true, false) {
		return t.Tx.Commit(ctx)
	}
	if err := t.Tx.Rollback(ctx); err != nil {
		return err
	}
	z, err := openZombie(ctx, t.db.url, t.db.name, t.event)
	if err != nil {
		return err
	}
	t.db.zombie <- z
	return fmt.Errorf("commit: %w", errors.New("unexpected EOF"))
}

// zombieHandler records applications and marks the transaction of its
// event for zombieAtCommit.
type zombieHandler struct{ *recorder }

func (h zombieHandler) Handle(ctx context.Context, tx pgx.Tx, m *Message) error {
	if zt, ok := tx.(*zombieTx); ok {
		zt.event = m.ID
	}
	return h.recorder.Handle(ctx, tx, m)
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
	for _, atCommit := range []bool{false, true} {
		name := map[bool]string{false: "dedup insert", true: "commit probe"}[atCommit]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			zombieNeitherCharges(t, atCommit)
		})
	}
}

func zombieNeitherCharges(t *testing.T, atCommit bool) {
	f := newFixture(t)
	name := map[bool]string{false: "zombieinsert", true: "zombieprobe"}[atCommit]
	cfg := f.baseConfig(name)
	cfg.HandlerTimeout = time.Second
	cfg.MaxAttempts, cfg.TransientAttempts = 1, 1
	e := event{ID: uuidN(1), AggID: "z", Version: 1}
	ctx := context.Background()
	zombies := make(chan *pgx.Conn, 1)
	var db DB = f.pool
	if atCommit {
		zdb := &zombieAtCommit{Pool: f.pool, url: f.db.URL, name: name, zombie: zombies}
		zdb.armed.Store(true)
		db = zdb
	} else {
		z, err := openZombie(ctx, f.db.URL, name, e.ID)
		testenv.Must(t, err, "open zombie")
		zombies <- z
	}
	r := newRecorder(name)
	c, err := New(db, f.js, cfg, zombieHandler{r}, WithLogger(zaptest.NewLogger(t)), WithRegisterer(f.reg))
	testenv.Must(t, err, "new consumer")
	f.run(c)
	f.publish(e)
	var z *pgx.Conn
	select {
	case z = <-zombies:
		t.Cleanup(func() { z.Close(context.Background()) })
	case <-time.After(20 * time.Second):
		t.Fatalf("no zombie was made: the handler never committed")
	}
	f.waitFor("the event applied", 30*time.Second, func() bool {
		return queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE consumer = $1`, name) > 0 ||
			queryInt(t, f.pool, `SELECT count(*) FROM consumer_dead_letter WHERE consumer = $1`, name) > 0
	})
	var reason string
	if err := f.pool.QueryRow(ctx, `SELECT reason FROM consumer_dead_letter WHERE consumer = $1`, name).Scan(&reason); err == nil {
		t.Fatalf("dead-lettered: %s", reason)
	}
	f.waitSettled(name, 15*time.Second)
	if n := queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE consumer = $1`, name); n != 1 {
		t.Fatalf("applied %d times, want 1", n)
	}
	if n := queryInt(t, f.pool, `SELECT count(*) FROM consumed_message WHERE consumer = $1 AND content_hash IS NOT NULL`, name); n != 1 {
		t.Fatalf("%d dedup rows of the consumer's own, want 1", n)
	}
	if got := metricValue(t, mustVec(t, f).retries.WithLabelValues(name, string(ClassUnknown))); got != 0 {
		t.Fatalf("%v unknown retries charged for the zombie's wait, want 0", got)
	}
	if _, err := z.Exec(ctx, `SELECT 1`); err == nil {
		t.Fatalf("the zombie's session is still alive")
	}
}
