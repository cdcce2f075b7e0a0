package replication

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/replication/internal/pgoutput"
)

// A publication dropped and created again leaves a stretch of WAL that
// pgoutput cannot decode with it: it looks the publication up as of each
// change and fails with 42704. The relay publishes the stretch's outbox
// rows from the tables and advances the slot past it, but logical
// messages (pg_logical_emit_message) live only in the WAL. They are read
// first through the message publication: an empty one, created by setup
// beside the publication and never dropped, so that it exists at every
// position of any stretch; with no table in it, pgoutput sends only the
// messages.

// ErrStretchUnreadable means the logical messages of an undecodable
// stretch cannot be read: the message publication did not exist at some
// position of it (created after the stretch began, or never).
var ErrStretchUnreadable = errors.New("the logical messages of the WAL the slot cannot decode cannot be read")

// MessagePublication is the name of cfg's message publication: the
// publication's name with "_messages" (cut to PostgreSQL's 63 bytes).
func MessagePublication(cfg Config) string {
	const suffix = "_messages"
	name := cfg.Publication
	if len(name)+len(suffix) > 63 {
		name = name[:63-len(suffix)]
	}
	return name + suffix
}

// ensureMessagePublication creates the message publication when missing.
func ensureMessagePublication(ctx context.Context, conn *pgx.Conn, cfg Config, rep *SetupReport) error {
	name := MessagePublication(cfg)
	exists, err := publicationExists(ctx, conn, name)
	if err != nil || exists {
		return err
	}
	stmt := "CREATE PUBLICATION " + pgx.Identifier{name}.Sanitize()
	_, err = conn.Exec(ctx, stmt)
	var pgErr *pgconn.PgError
	switch {
	case createdMeanwhile(err):
		return nil
	case errors.As(err, &pgErr) && pgErr.Code == pgerrcode.InsufficientPrivilege:
		// Not fatal: it matters only to logical messages, and only if the
		// publication is ever dropped and created again.
		rep.add("could not create publication %s (%s): as a role with CREATE on the database run %s (sql/least-privilege-owner.sql); without it, logical messages written while the publication is dropped and created again are lost", name, pgErr.Message, stmt)
		return nil
	case err != nil:
		return fmt.Errorf("create the message publication %q: %w", name, err)
	}
	rep.add("created publication %s (no tables: reads logical messages if the publication is ever dropped and created again)", name)
	return nil
}

// StretchMessage is a logical message read from an undecodable stretch.
type StretchMessage struct {
	Message
	// Commit is the enclosing transaction's commit, zero for a
	// non-transactional message.
	Commit Begin
}

// StretchMessages reads the logical messages of transactions the slot
// would skip if advanced to upto (its stretch from the confirmed position)
// through the message publication, without consuming them, and calls fn
// for each in commit order. The slot must not be streamed meanwhile. A
// stretch the message publication does not cover fails with
// ErrStretchUnreadable.
func (w *PublicationWatch) StretchMessages(ctx context.Context, upto LSN, fn func(*StretchMessage) error) error {
	if err := w.connect(ctx); err != nil {
		return err
	}
	err := retryInUse(ctx, func() error { return w.readStretch(ctx, upto, fn) })
	var pgErr *pgconn.PgError
	switch {
	case errors.As(err, &pgErr) && pgErr.Code == pgerrcode.UndefinedObject:
		return w.after(fmt.Errorf("%w: %v (publication %q was created after the stretch began, or never: `outbox-relay setup` creates it for the next time)", ErrStretchUnreadable, err, MessagePublication(w.cfg)))
	case errors.As(err, &pgErr):
		return w.after(fmt.Errorf("read the logical messages of slot %q up to %s: %w", w.cfg.Slot, upto, err))
	}
	return err
}

func (w *PublicationWatch) readStretch(ctx context.Context, upto LSN, fn func(*StretchMessage) error) error {
	rows, err := w.conn.Query(ctx, `SELECT data FROM pg_logical_slot_peek_binary_changes($1, $2::pg_lsn, NULL,
	'proto_version', '1', 'publication_names', $3, 'messages', 'true')`, w.cfg.Slot, upto.String(), pgx.Identifier{MessagePublication(w.cfg)}.Sanitize())
	if err != nil {
		return err
	}
	defer rows.Close()
	var m StretchMessage
	var begin pgoutput.Begin
	var raw pgoutput.Message
	for rows.Next() {
		data := rows.RawValues()[0]
		if len(data) == 0 {
			continue
		}
		switch data[0] {
		case pgoutput.TypeBegin:
			if err := pgoutput.DecodeBegin(data[1:], &begin); err != nil {
				return w.after(fmt.Errorf("%w: %v", ErrProtocol, err))
			}
		case pgoutput.TypeMessage:
			if err := pgoutput.DecodeMessage(data[1:], &raw); err != nil {
				return w.after(fmt.Errorf("%w: %v", ErrProtocol, err))
			}
			m = StretchMessage{Message: Message{Transactional: raw.Transactional, Prefix: raw.Prefix, Content: append([]byte(nil), raw.Content...), LSN: LSN(raw.LSN)}}
			if raw.Transactional {
				m.Commit = Begin{XID: begin.XID, FinalLSN: LSN(begin.FinalLSN), CommitTime: begin.CommitTime}
				m.Tx = &m.Commit
			}
			if err := fn(&m); err != nil {
				return err
			}
		}
	}
	return rows.Err()
}

// Position reads the server's WAL insert position (on a standby, its
// replay position): every transaction visible now committed before it. It
// returns once the WAL is flushed to it: a slot is read, and advanced,
// only up to the flushed WAL, which lags behind the commits of
// transactions with synchronous_commit off.
func (w *PublicationWatch) Position(ctx context.Context) (LSN, error) {
	if err := w.connect(ctx); err != nil {
		return 0, err
	}
	var s string
	err := w.conn.QueryRow(ctx, "SELECT "+insertLSN+"::text").Scan(&s)
	if err != nil {
		return 0, w.after(fmt.Errorf("read the WAL position: %w", err))
	}
	pos, err := parseLSN(s)
	if err != nil {
		return 0, err
	}
	for {
		var flushed bool
		err := w.conn.QueryRow(ctx, "SELECT pg_is_in_recovery() OR pg_current_wal_flush_lsn() >= $1::pg_lsn", pos.String()).Scan(&flushed)
		if err != nil {
			return 0, w.after(fmt.Errorf("wait for the WAL to be flushed to %s: %w", pos, err))
		}
		if flushed {
			return pos, nil
		}
		select {
		case <-ctx.Done():
			return 0, fmt.Errorf("wait for the WAL to be flushed to %s: %w", pos, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}
