package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// confirmedEvent is an event the seed's CTE wrote to the outbox: the demo
// expects each one in the stream.
type confirmedEvent struct {
	EventID        string
	RegistrationID string
	Version        int64
}

// confirmSQL reads the seed's data-modifying CTE from
// sql/example_registration.sql (between its BEGIN/END EXAMPLE markers) and
// binds the named parameters as $1 registration_id, $2 expected_version and
// $3 event_id. Running the documented text keeps the demo and the file from
// drifting apart (sql/sql_test.go does the same).
func confirmSQL(sqlDir string) (string, error) {
	path := filepath.Join(sqlDir, "example_registration.sql")
	b, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	_, rest, ok := strings.Cut(string(b), "-- BEGIN EXAMPLE confirm_registration\n")
	example, _, ok2 := strings.Cut(rest, "-- END EXAMPLE")
	if !ok || !ok2 {
		return "", fmt.Errorf("%s: no BEGIN/END EXAMPLE confirm_registration markers around the CTE", path)
	}
	var lines []string
	for _, l := range strings.Split(strings.TrimSpace(example), "\n") {
		lines = append(lines, strings.TrimPrefix(strings.TrimPrefix(l, "--"), " "))
	}
	q := strings.TrimSuffix(strings.TrimSpace(strings.Join(lines, "\n")), ";")
	q = strings.NewReplacer(":registration_id", "$1", ":expected_version", "$2", ":event_id", "$3").Replace(q)
	if strings.Contains(q, " :") || strings.Contains(q, "(:") {
		return "", fmt.Errorf("%s: the example uses a parameter the demo does not bind", path)
	}
	return q, nil
}

// insertRegistrations creates n registrations awaiting payment. The
// registration table is not in the publication: these inserts produce no
// event, only the confirmations below do.
func insertRegistrations(ctx context.Context, pool *pgxpool.Pool, n int) ([]string, error) {
	ids := make([]string, n)
	for i := range ids {
		ids[i] = uuid.NewString()
		if _, err := pool.Exec(ctx, `INSERT INTO registration (id, status, version) VALUES ($1, 'PENDING_PAYMENT', 1)`, ids[i]); err != nil {
			return nil, fmt.Errorf("insert registration: %w", err)
		}
	}
	return ids, nil
}

// confirm runs the seed's CTE in its own transaction, as the seed does, and
// returns the event it wrote, or ok=false when the conditional UPDATE matched
// no row and therefore no event was written.
func confirm(ctx context.Context, pool *pgxpool.Pool, q, registrationID string, expectedVersion int64) (ev confirmedEvent, ok bool, err error) {
	eventID := uuid.NewString()
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, q, registrationID, expectedVersion, eventID)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var id uuid.UUID
			var version int64
			if err := rows.Scan(&id, &version); err != nil {
				return err
			}
			if ok {
				return errors.New("the CTE returned more than one row")
			}
			ev, ok = confirmedEvent{EventID: id.String(), RegistrationID: registrationID, Version: version}, true
		}
		return rows.Err()
	})
	if err != nil {
		return confirmedEvent{}, false, fmt.Errorf("confirm registration %s: %w", registrationID, err)
	}
	return ev, ok, nil
}

// confirmRegistrations drives the seed's flow: confirm every registration
// once at version 1, then confirm the first one again with the same, now
// stale, expected version to show the zero-row path.
func (d *demo) confirmRegistrations(ctx context.Context) error {
	q, err := confirmSQL(d.sqlDir)
	if err != nil {
		return err
	}
	ids, err := insertRegistrations(ctx, d.appPool, d.opts.registrations)
	if err != nil {
		return err
	}
	d.out.step("inserted %d registrations (status PENDING_PAYMENT, version 1); the registration table is not relayed", len(ids))
	d.out.step("confirming them with the seed's CTE (UPDATE registration ... RETURNING feeds INSERT INTO outbox)")
	for _, id := range ids {
		ev, ok, err := confirm(ctx, d.appPool, q, id, 1)
		if err != nil {
			return err
		}
		if !ok {
			return fmt.Errorf("confirm registration %s at version 1 returned no row", id)
		}
		d.expect(ev)
		d.out.detail("registration %s: expected version 1 -> CONFIRMED, outbox event %s at version %d", short(id), short(ev.EventID), ev.Version)
	}

	// The zero-row path: a retry (or a concurrent request) with a stale
	// expected version changes nothing and writes no event; the seed says
	// the caller must then read the registration's state.
	stale := ids[0]
	_, ok, err := confirm(ctx, d.appPool, q, stale, 1)
	if err != nil {
		return err
	}
	if ok {
		return fmt.Errorf("a second confirm of registration %s with stale version 1 wrote an event", stale)
	}
	var status string
	var version int64
	if err := d.appPool.QueryRow(ctx, `SELECT status, version FROM registration WHERE id = $1`, stale).Scan(&status, &version); err != nil {
		return fmt.Errorf("read registration %s: %w", stale, err)
	}
	d.out.detail("registration %s: expected version 1 again (stale) -> 0 rows, no event; its state is %s at version %d", short(stale), status, version)
	return nil
}
