package replication

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// IsConnectFailure reports whether err is a failure to open a session with
// any host of the URL that a failover explains: refused, unreachable, a
// server starting up or shutting down, or only standbys answering where a
// primary is needed. Asking again costs one connection attempt, which is
// why the relay does not back off far from these (after a promotion it
// must find the new primary within seconds). A rejected password or a
// missing database is not one: those wait for an operator.
func IsConnectFailure(err error) bool {
	if errors.Is(err, ErrNoPrimary) {
		return true
	}
	var ce *pgconn.ConnectError
	if !errors.As(err, &ce) {
		return false
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && (pgerrcode.IsInvalidAuthorizationSpecification(pgErr.Code) || pgErr.Code == pgerrcode.InvalidCatalogName) {
		return false
	}
	return true
}

// IsServerGone reports whether err is a session that its server ended
// under the relay: the connection closed mid-exchange (EOF, reset, broken
// pipe) or the server shutting down or crashing (SQLSTATE 57P01, 57P02).
// In a failover it is the old primary's last word, met by whichever of the
// relay's sessions speaks to it next (the stream, the publication check),
// and like IsConnectFailure it is retried within a second: the next
// attempt is one connection, which finds the new primary or fails with a
// connect error.
func IsServerGone(err error) bool {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) {
		return true
	}
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == pgerrcode.AdminShutdown || pgErr.Code == pgerrcode.CrashShutdown)
}

// connectFailure adds ErrNoPrimary, with the fix, to a connection error
// whose hosts refused a read-write session (target_session_attrs).
func connectFailure(err error) error {
	if errors.Is(err, pgconn.ErrReadOnlyConnection) || errors.Is(err, pgconn.ErrStandbyConnection) {
		return &ActionableError{Err: ErrNoPrimary, Detail: err.Error(),
			Hint: "every host of postgres.url that answered is a standby (target_session_attrs asks for a primary): " +
				"during a failover this passes once a standby is promoted; otherwise add the primary to postgres.url"}
	}
	return err
}

// CheckSlotNotLost fails with the failover recovery (ErrSlotMissing) when
// the slot does not exist on a server that was promoted from a standby
// while streamHasEvents says the relay has published before: the slot was
// lost in a failover, and creating a new one at the current position, as
// auto_setup would, skips what was committed in between. It returns nil
// when the slot exists, on a server never promoted, and for a first start.
func CheckSlotNotLost(ctx context.Context, url, slot string, streamHasEvents func(context.Context) (bool, error)) error {
	conn, err := connectSQL(ctx, url)
	if err != nil {
		return connectFailure(err)
	}
	defer conn.Close(ctx)
	st, err := slotStatus(ctx, conn, slot)
	if err != nil || st.Exists {
		return err
	}
	err = missingSlotError(ctx, conn, slot)
	var ae *ActionableError
	if !errors.As(err, &ae) || !strings.Contains(ae.Detail, "promoted from a standby") {
		return nil // never promoted: a first start
	}
	published, serr := streamHasEvents(ctx)
	if serr != nil {
		return fmt.Errorf("look up the event stream before creating slot %q on a promoted server: %w", slot, serr)
	}
	if !published {
		return nil
	}
	return err
}

// missingSlotError explains a missing slot. On a server that was promoted
// from a standby (its timeline is above 1) the likeliest cause is a
// failover that the slot did not survive, and the fix is not only setup.
func missingSlotError(ctx context.Context, conn *pgx.Conn, slot string) error {
	var tlHex string
	// The WAL file name starts with the timeline, in hex; the function
	// fails on a standby, where the question does not arise.
	if err := conn.QueryRow(ctx, "SELECT substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8)").Scan(&tlHex); err == nil {
		if tl, err := strconv.ParseUint(tlHex, 16, 32); err == nil && tl > 1 {
			return actionable(ErrSlotMissing,
				"if the relay streamed from this slot before, the slot did not survive a primary failover (only a PostgreSQL 17 failover slot synchronised to the promoted standby does), "+
					"and events committed after its last confirmed position were not relayed: stop the relays, run `outbox-relay setup`, then "+
					"`outbox-relay reconcile --since <the time of the last event in the stream, minus a margin> --repair --include-pending --confirm-wait 0`, "+
					"then start the relay (docs/operations.md, \"Primary failover on PostgreSQL 16 or older\"); if the slot never existed, run `outbox-relay setup`",
				"slot %q does not exist on this server, which was promoted from a standby (timeline %d)", slot, tl)
		}
	}
	return actionable(ErrSlotMissing, "run `outbox-relay setup`", "slot %q", slot)
}

// FailoverReport says whether promoting a standby now would keep the
// relay's slot, and the relay's guarantees, on the new primary.
type FailoverReport struct {
	// PrimaryVersion is the primary's server_version_num.
	PrimaryVersion int `json:"primary_version_num"`
	// Standbys is how many physical standbys the primary has (physical
	// slots or physical walsenders, which are connected to no database:
	// a logical walsender without a slot yet, such as a relay starting or
	// a backfill's snapshot connection, is none): 0 means no failover is
	// possible, and nothing is at risk.
	Standbys int `json:"standbys"`
	// FailoverSlot is the slot's failover flag (PostgreSQL 17+).
	FailoverSlot bool `json:"failover_slot"`
	// SynchronizedStandbySlots is the primary's synchronized_standby_slots.
	SynchronizedStandbySlots string `json:"synchronized_standby_slots,omitempty"`
	// Checked are the standbys of postgres.url whose copy of the slot was
	// inspected.
	Checked []StandbySlot `json:"checked_standbys,omitempty"`
	// Problems are the reasons a failover now would lose the slot or
	// publish events the promoted standby never received; each names the
	// setting to change. Empty when the failover is safe or impossible.
	Problems []string `json:"problems,omitempty"`
	// Unverified says why the standbys' copies could not be checked (none
	// listed in postgres.url); the primary's side may still be right.
	Unverified string `json:"unverified,omitempty"`
}

// AtRisk reports whether a failover now would lose the slot (or publish
// events that the new primary does not have).
func (r FailoverReport) AtRisk() bool { return len(r.Problems) > 0 }

// StandbySlot is one standby's copy of the slot.
type StandbySlot struct {
	Host string `json:"host"`
	// Ready: the copy exists, is synchronised from the primary, persistent
	// and valid, so the relay resumes from it after promoting this standby.
	Ready   bool   `json:"ready"`
	Problem string `json:"problem,omitempty"`
}

// CheckFailover inspects the primary of url (the first host that is not in
// recovery) and every standby url lists, and reports whether a failover now
// would keep the slot. It needs only the relay's own role: it reads
// pg_replication_slots, pg_stat_replication and settings.
func CheckFailover(ctx context.Context, url, slot string) (FailoverReport, error) {
	var rep FailoverReport
	hosts, err := urlHosts(url)
	if err != nil {
		return rep, err
	}
	primary, standbys, firstErr := connectHosts(ctx, hosts)
	defer func() {
		if primary != nil {
			primary.Close(context.Background())
		}
		for _, s := range standbys {
			s.conn.Close(context.Background())
		}
	}()
	if primary == nil {
		return rep, cmpOr(firstErr, fmt.Errorf("%w: no host of postgres.url is a primary", ErrNoPrimary))
	}
	info, err := ReadServerInfo(ctx, primary)
	if err != nil {
		return rep, err
	}
	rep.PrimaryVersion = info.VersionNum
	err = primary.QueryRow(ctx, `SELECT greatest(
  (SELECT count(*) FROM pg_replication_slots WHERE slot_type = 'physical'),
  (SELECT count(*) FROM pg_stat_replication r JOIN pg_stat_activity a ON a.pid = r.pid
     WHERE a.datname IS NULL))::int`).Scan(&rep.Standbys)
	if err != nil {
		return rep, fmt.Errorf("count standbys: %w", err)
	}
	if rep.Standbys == 0 && len(standbys) == 0 {
		return rep, nil
	}
	if info.VersionNum < VersionFailoverSlots {
		rep.Problems = append(rep.Problems, fmt.Sprintf(
			"PostgreSQL %s has no failover slots: a promoted standby has no slot %q, and the events after its last confirmed position must be republished (setup, then reconcile --repair: docs/operations.md, \"Primary failover on PostgreSQL 16 or older\"); PostgreSQL 17 with postgres.failover_slot: true avoids it",
			versionString(info.VersionNum), slot))
		return rep, nil
	}
	var exists bool
	err = primary.QueryRow(ctx, `SELECT true, failover, current_setting('synchronized_standby_slots')
FROM pg_replication_slots WHERE slot_name = $1`, slot).Scan(&exists, &rep.FailoverSlot, &rep.SynchronizedStandbySlots)
	if errors.Is(err, pgx.ErrNoRows) {
		rep.Problems = append(rep.Problems, fmt.Sprintf("slot %q does not exist on the primary: run `outbox-relay setup`", slot))
		return rep, nil
	}
	if err != nil {
		return rep, fmt.Errorf("read slot %q: %w", slot, err)
	}
	if !rep.FailoverSlot {
		rep.Problems = append(rep.Problems, fmt.Sprintf(
			"slot %q has failover = false, so no standby keeps a copy: set postgres.failover_slot: true and recreate the slot (docs/operations.md, \"Failover slots on PostgreSQL 17\")", slot))
	}
	if err := checkSynchronizedSlots(ctx, primary, rep.SynchronizedStandbySlots, &rep); err != nil {
		return rep, err
	}
	if !rep.FailoverSlot {
		return rep, nil
	}
	if len(standbys) == 0 {
		rep.Unverified = "postgres.url lists no standby, so their copies of the slot were not checked: add the standbys as further hosts (postgres://primary,standby/db?target_session_attrs=read-write)"
		return rep, nil
	}
	rep.Checked = checkCopies(ctx, standbys, slot)
	var why []string
	for _, s := range rep.Checked {
		if s.Ready {
			return rep, nil
		}
		why = append(why, s.Host+": "+s.Problem)
	}
	rep.Problems = append(rep.Problems, "no standby has a failover-ready copy of slot "+strconv.Quote(slot)+", so promoting one now would lose it ("+strings.Join(why, "; ")+")")
	return rep, nil
}

// hostConn is a connection to one host of the URL.
type hostConn struct {
	host string
	conn *pgx.Conn
}

// connectHosts connects to every host and sorts them: the first that is not
// in recovery is the primary (others are closed), the rest are standbys.
// err is the first failure, for when no primary answers.
func connectHosts(ctx context.Context, hosts []urlHost) (primary *pgx.Conn, standbys []hostConn, err error) {
	for _, h := range hosts {
		conn, cerr := pgx.ConnectConfig(ctx, h.cfg)
		if cerr != nil {
			err = cmpOr(err, fmt.Errorf("connect to %s: %w", h.name, cerr))
			continue
		}
		var recovery bool
		if qerr := conn.QueryRow(ctx, "SELECT pg_is_in_recovery()").Scan(&recovery); qerr != nil {
			conn.Close(ctx)
			err = cmpOr(err, fmt.Errorf("read pg_is_in_recovery() on %s: %w", h.name, qerr))
			continue
		}
		switch {
		case recovery:
			standbys = append(standbys, hostConn{h.name, conn})
		case primary == nil:
			primary = conn
		default:
			conn.Close(ctx)
		}
	}
	return primary, standbys, err
}

// checkCopies inspects each standby's copy of slot.
func checkCopies(ctx context.Context, standbys []hostConn, slot string) []StandbySlot {
	out := make([]StandbySlot, 0, len(standbys))
	for _, s := range standbys {
		out = append(out, standbySlot(ctx, s.conn, s.host, slot))
	}
	return out
}

// checkSynchronizedSlots adds a problem unless synchronized_standby_slots
// names at least one physical slot, and every one it names exists.
func checkSynchronizedSlots(ctx context.Context, primary *pgx.Conn, setting string, rep *FailoverReport) error {
	if strings.TrimSpace(setting) == "" {
		rep.Problems = append(rep.Problems,
			"synchronized_standby_slots is empty on the primary: the relay may publish events no standby has received, and a failover then keeps them in the stream but not in the database; "+
				"set it to the standbys' physical slots (ALTER SYSTEM SET synchronized_standby_slots = '<slot>'; SELECT pg_reload_conf())")
		return nil
	}
	for _, name := range strings.Split(setting, ",") {
		name = strings.TrimSpace(name)
		var n int
		if err := primary.QueryRow(ctx, "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1 AND slot_type = 'physical'", name).Scan(&n); err != nil {
			return fmt.Errorf("look up physical slot %q: %w", name, err)
		}
		if n == 0 {
			rep.Problems = append(rep.Problems, fmt.Sprintf(
				"synchronized_standby_slots names %q, which is not a physical slot on the primary: logical walsenders wait for it, so the relay stalls; fix the setting", name))
		}
	}
	return nil
}

// standbySlot inspects a standby's copy of slot.
func standbySlot(ctx context.Context, conn *pgx.Conn, host, slot string) StandbySlot {
	ss := StandbySlot{Host: host}
	var syncOn, feedback string
	if err := conn.QueryRow(ctx, "SELECT current_setting('sync_replication_slots'), current_setting('hot_standby_feedback')").Scan(&syncOn, &feedback); err != nil {
		ss.Problem = fmt.Sprintf("cannot read its settings (PostgreSQL 17 or later needed for failover slots): %v", err)
		return ss
	}
	var synced, temporary bool
	var invalidation *string
	err := conn.QueryRow(ctx, "SELECT synced, temporary, invalidation_reason FROM pg_replication_slots WHERE slot_name = $1", slot).Scan(&synced, &temporary, &invalidation)
	switch {
	case syncOn != "on":
		ss.Problem = "sync_replication_slots is off: set it on, with hot_standby_feedback = on, primary_slot_name and a dbname in primary_conninfo"
	case feedback != "on":
		ss.Problem = "hot_standby_feedback is off: slot synchronisation needs it on"
	case errors.Is(err, pgx.ErrNoRows):
		ss.Problem = "the slot is not synchronised yet (check primary_slot_name, a dbname in primary_conninfo, and the standby's log)"
	case err != nil:
		ss.Problem = fmt.Sprintf("cannot read its slots: %v", err)
	case invalidation != nil:
		ss.Problem = "its copy is invalidated (" + *invalidation + ")"
	case !synced:
		ss.Problem = "a slot of that name exists there but is not synchronised from the primary"
	case temporary:
		ss.Problem = "its copy is not persisted yet: the standby keeps it temporary until the primary's slot moves past the standby's own horizon (the relay streaming moves it; the standby's log says \"could not synchronize replication slot\" meanwhile)"
	default:
		ss.Ready = true
	}
	return ss
}

type urlHost struct {
	name string
	cfg  *pgx.ConnConfig
}

// urlHosts splits a (multi-host) connection string into one ordinary
// connection config per host, each accepting any session.
func urlHosts(url string) ([]urlHost, error) {
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("parse postgres URL: %w", redactErr(err))
	}
	delete(cfg.RuntimeParams, "replication")
	if cfg.ConnectTimeout == 0 {
		cfg.ConnectTimeout = 5 * time.Second
	}
	// pgconn lists a host once per TLS mode (sslmode=prefer: with, then
	// without): keep each host's entries together, in order.
	type entry struct {
		host string
		port uint16
		tls  *tls.Config
	}
	entries := []entry{{cfg.Host, cfg.Port, cfg.TLSConfig}}
	for _, fb := range cfg.Fallbacks {
		entries = append(entries, entry{fb.Host, fb.Port, fb.TLSConfig})
	}
	var hosts []urlHost
	index := map[string]int{}
	for _, e := range entries {
		name := net.JoinHostPort(e.host, strconv.Itoa(int(e.port)))
		if i, ok := index[name]; ok {
			c := hosts[i].cfg
			c.Fallbacks = append(c.Fallbacks, &pgconn.FallbackConfig{Host: e.host, Port: e.port, TLSConfig: e.tls})
			continue
		}
		c := cfg.Copy()
		c.Host, c.Port, c.TLSConfig, c.Fallbacks, c.ValidateConnect = e.host, e.port, e.tls, nil, nil
		index[name] = len(hosts)
		hosts = append(hosts, urlHost{name: name, cfg: c})
	}
	return hosts, nil
}

func cmpOr(a, b error) error {
	if a != nil {
		return a
	}
	return b
}
