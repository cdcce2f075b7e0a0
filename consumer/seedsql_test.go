package consumer

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// rewardDB calls the seed's reward functions and reads what they wrote.
type rewardDB struct {
	t *testing.T
	f *fixture
}

func (r rewardDB) apply(event, player string, delta any) (bool, error) {
	var applied bool
	err := r.f.pool.QueryRow(context.Background(), `SELECT apply_reward_event('rewards', $1, $2, $3)`, event, player, delta).Scan(&applied)
	return applied, err
}

func (r rewardDB) points(player string) int64 {
	return queryInt(r.t, r.f.pool, `SELECT points FROM reward_account WHERE player_id = $1`, player)
}

func (r rewardDB) dedupRows(event string) int64 {
	return queryInt(r.t, r.f.pool, `SELECT count(*) FROM consumed_message WHERE consumer = 'rewards' AND event_id = $1`, event)
}

func sqlstate(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// The seed's apply_reward_event runs unchanged against the library's
// consumed_message table. Each branch of the function is covered.
func TestApplyRewardEvent(t *testing.T) {
	t.Parallel()
	env := testenv.Get(t)
	db := env.NewDatabase(t)
	f := newFixtureOn(t, db, env.NATS.URL)
	ctx := context.Background()
	const player = "11111111-1111-4111-8111-111111111111"
	mustExec(t, f.pool, `INSERT INTO reward_account (player_id, points) VALUES ($1, 0)`, player)

	r := rewardDB{t: t, f: f}
	apply, points, dedupRows := r.apply, func() int64 { return r.points(player) }, r.dedupRows

	t.Run("applied returns true", func(t *testing.T) {
		ok, err := apply(uuidN(1), player, 10)
		if err != nil || !ok {
			t.Fatalf("apply = %v, %v; want true", ok, err)
		}
		if p := points(); p != 10 {
			t.Fatalf("points %d, want 10", p)
		}
		// The library's extra columns are defaulted or null for the
		// function's row.
		var outcome string
		var hash []byte
		err = f.pool.QueryRow(ctx, `SELECT outcome, content_hash FROM consumed_message WHERE consumer = 'rewards' AND event_id = $1`,
			uuidN(1)).Scan(&outcome, &hash)
		if err != nil || outcome != "applied" || hash != nil {
			t.Fatalf("dedup row outcome %q hash %x err %v", outcome, hash, err)
		}
	})
	t.Run("duplicate returns false", func(t *testing.T) {
		ok, err := apply(uuidN(1), player, 10)
		if err != nil || ok {
			t.Fatalf("apply = %v, %v; want false", ok, err)
		}
		if p := points(); p != 10 {
			t.Fatalf("points %d, want 10", p)
		}
	})
	t.Run("non-positive delta raises", func(t *testing.T) {
		for _, delta := range []any{0, -5, nil} {
			_, err := apply(uuidN(2), player, delta)
			if sqlstate(err) != pgerrcode.RaiseException {
				t.Fatalf("delta %v: err %v, want raise_exception", delta, err)
			}
			if n := dedupRows(uuidN(2)); n != 0 {
				t.Fatalf("delta %v left a dedup row", delta)
			}
		}
	})
	t.Run("missing account raises and rolls back the dedup row", func(t *testing.T) {
		tx, err := f.pool.Begin(ctx)
		testenv.Must(t, err, "begin")
		var ok bool
		err = tx.QueryRow(ctx, `SELECT apply_reward_event('rewards', $1, $2, 10)`, uuidN(3),
			"22222222-2222-4222-8222-222222222222").Scan(&ok)
		_ = tx.Rollback(ctx)
		if sqlstate(err) != pgerrcode.RaiseException {
			t.Fatalf("err %v, want raise_exception 'reward account not found'", err)
		}
		if n := dedupRows(uuidN(3)); n != 0 {
			t.Fatalf("missing account left a dedup row")
		}
	})
	t.Run("integer overflow raises and rolls back", func(t *testing.T) {
		mustExec(t, f.pool, `UPDATE reward_account SET points = 2147483640 WHERE player_id = $1`, player)
		_, err := apply(uuidN(4), player, 10)
		if sqlstate(err) != pgerrcode.NumericValueOutOfRange {
			t.Fatalf("err %v, want numeric_value_out_of_range", err)
		}
		if n := dedupRows(uuidN(4)); n != 0 {
			t.Fatalf("overflow left a dedup row")
		}
		if p := points(); p != 2147483640 {
			t.Fatalf("points %d changed", p)
		}
	})
}
