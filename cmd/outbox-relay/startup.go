package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nats-io/nats.go"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/backoff"
	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/replication"
)

// What `run` does when a server is down at start: it waits, with backoff,
// serving /healthz 200 and /readyz 503, because an orchestrator restarting
// the process would only wait longer (CrashLoopBackOff), and a database or
// broker that starts after the relay (docker compose, a node reboot) is
// normal. A refusal that no waiting cures — a wrong password, a missing
// database, a role without a grant, a lost slot — ends it at once.
const (
	startupRetryMin = 500 * time.Millisecond
	startupRetryMax = 10 * time.Second
	// natsWaitFirstLog is when the wait for NATS first says it waits, and
	// why; natsWaitLog how often it says so again.
	natsWaitFirstLog = 2 * time.Second
	natsWaitLog      = 10 * time.Second
)

// retryStartup runs f until it succeeds, returns an error that waiting
// does not cure, or ctx ends.
func retryStartup(ctx context.Context, log *zap.Logger, f func() error) error {
	for attempt := 1; ; attempt++ {
		err := f()
		if err == nil || ctx.Err() != nil || !startupRetryable(err) {
			return err
		}
		wait := backoff.Step(startupRetryMin, startupRetryMax, attempt)
		log.Warn("postgres unreachable at start; retrying", zap.Int("attempt", attempt), zap.Duration("retry_in", wait), zap.Error(err))
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(wait):
		}
	}
}

// startupRetryable reports whether err means "the server is not there
// yet" rather than "the server said no": network errors, and the SQLSTATE
// classes of a server starting, shutting down or out of connections.
func startupRetryable(err error) bool {
	if replication.IsPermanent(err) || errors.Is(err, config.ErrInvalid) {
		return false
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch pgErr.Code[:2] {
		case "08", // connection exception
			"53", // insufficient resources (too many connections)
			"57": // operator intervention (starting up, shutting down, admin shutdown)
			return true
		}
		return false // authorization, a missing database, privileges, ...
	}
	var netErr net.Error
	var opErr *net.OpError
	var dnsErr *net.DNSError
	return errors.As(err, &netErr) || errors.As(err, &opErr) || errors.As(err, &dnsErr) || pgconn.Timeout(err)
}

// lingerHelps reports whether serving /metrics a while before exiting
// shows the cause to an alert: a slot that is lost, missing or foreign is
// in the slot gauges. A refusal such as a wrong password is in the log
// only, and lingering would just delay the restart.
func lingerHelps(err error) bool {
	return errors.Is(err, replication.ErrSlotLost) || errors.Is(err, replication.ErrSlotMissing) || errors.Is(err, replication.ErrSlotMismatch)
}

// waitNATS waits until nc is connected, ctx ends or timeout passes (0: no
// timeout), logging why it still waits. A server that refuses the
// credentials ends the wait at once.
func waitNATS(ctx context.Context, nc *nats.Conn, attempts *natsAttempts, url string, timeout time.Duration, log *zap.Logger) error {
	start := time.Now()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	nextLog := start.Add(natsWaitFirstLog)
	for !nc.IsConnected() {
		last := nc.LastError()
		if last == nil {
			last = attempts.err()
		}
		if natsAuthError(last) {
			return fmt.Errorf("connect to nats %s: %w (check nats.user/password, credentials_file or nkey_seed_file)", config.RedactURL(url), last)
		}
		if timeout > 0 && time.Since(start) > timeout {
			if last != nil {
				return fmt.Errorf("connect to nats %s: no server answered within %s: %w", config.RedactURL(url), timeout, last)
			}
			return fmt.Errorf("connect to nats %s: no server answered within %s", config.RedactURL(url), timeout)
		}
		if log != nil && !time.Now().Before(nextLog) {
			nextLog = time.Now().Add(natsWaitLog)
			log.Warn("nats unreachable at start; waiting", zap.String("url", config.RedactURL(url)), zap.Duration("waited", time.Since(start).Round(time.Second)), zap.Error(last))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
		}
	}
	return nil
}

func natsAuthError(err error) bool {
	return errors.Is(err, nats.ErrAuthorization) || errors.Is(err, nats.ErrAuthExpired) ||
		errors.Is(err, nats.ErrAuthRevoked) || errors.Is(err, nats.ErrAccountAuthExpired)
}

// causeFirst is an error whose message leads with PostgreSQL's refusal
// (leadWithCause); errors.Is and errors.As see the original.
type causeFirst struct{ err error }

func (e causeFirst) Error() string { return leadWithCause(e.err) }
func (e causeFirst) Unwrap() error { return e.err }

// leadWithCause puts PostgreSQL's own refusal, and what to do about it,
// before the connection attempts that led to it: pgconn reports a refused
// TLS attempt first ("tls error: server refused TLS connection") and the
// real cause, such as a wrong password, after it.
func leadWithCause(err error) string {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return err.Error()
	}
	hint := ""
	switch {
	case pgErr.Code == "28P01":
		hint = ": check the user and password in postgres.url"
	case pgErr.Code == "28000":
		hint = ": add a pg_hba.conf line for this role, database and address (and reload PostgreSQL)"
	case pgErr.Code == "3D000":
		hint = ": create the database or fix its name in postgres.url"
	case pgErr.Code == "42501":
		hint = ": grant the role what it lacks (README, step 2)"
	}
	return fmt.Sprintf("%s (SQLSTATE %s)%s [%s]", pgErr.Message, pgErr.Code, hint, withoutAttempts(err))
}

// withoutAttempts is err's text without pgconn's list of connection
// attempts: with sslmode=prefer it ends with the refused TLS attempt
// ("tls error: server refused TLS connection"), which reads as the cause
// and is not; the cause leads the message already.
func withoutAttempts(err error) string {
	var ce *pgconn.ConnectError
	if !errors.As(err, &ce) {
		return err.Error()
	}
	s := strings.TrimSuffix(strings.TrimSuffix(err.Error(), ce.Error()), ": ")
	if s == "" || s == err.Error() {
		return fmt.Sprintf("connect to postgres as %s to database %s", ce.Config.User, ce.Config.Database)
	}
	return s
}
