// Package config reads outbox-relay's configuration from a YAML file,
// environment variables and flags (precedence: flag > env > file > default),
// rejects unknown keys and invalid values with the key's path and a fix hint,
// and turns it into the typed configs of the relay's stages.
//
// Every scalar key has an environment variable: OUTBOX_RELAY_ followed by
// its path in upper case with dots as underscores, e.g. postgres.url is
// OUTBOX_RELAY_POSTGRES_URL and nats.max_in_flight is
// OUTBOX_RELAY_NATS_MAX_IN_FLIGHT. Lists (tables) come from the file only.
package config

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"regexp"
	"strings"
	"time"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/router"
)

// ErrInvalid is wrapped by every configuration error.
var ErrInvalid = errors.New("invalid configuration")

// Error names the key at fault.
type Error struct {
	Path string // e.g. postgres.url, tables[0].subject
	Msg  string
}

func (e *Error) Error() string { return e.Path + ": " + e.Msg }

// Unwrap returns ErrInvalid.
func (e *Error) Unwrap() error { return ErrInvalid }

// Config is the whole configuration file.
type Config struct {
	Postgres Postgres `yaml:"postgres"`
	NATS     NATS     `yaml:"nats"`
	// Tables, messages (table-less events written with
	// pg_logical_emit_message(true, prefix, envelope)),
	// dead_letter_subject and max_subject_bytes: the router's keys sit at
	// the top level of the file.
	Router          router.Config `yaml:",inline"`
	HTTP            HTTP          `yaml:"http"`
	Log             Log           `yaml:"log"`
	ShutdownTimeout time.Duration `yaml:"shutdown_timeout"`
	// Metrics configures the gauges polled from PostgreSQL and JetStream.
	Metrics Metrics `yaml:"metrics"`
	// Reconcile configures the relay's periodic reconciliation.
	Reconcile Reconcile `yaml:"reconcile"`
	// Tracing configures the relay's own OpenTelemetry spans; the exporter
	// comes from the standard OTEL_* environment variables.
	Tracing Tracing `yaml:"tracing"`

	// Warnings are Load's remarks on its input that did not stop it, for
	// the caller to show.
	Warnings []string `yaml:"-"`
}

// Metrics configures the polled gauges.
type Metrics struct {
	// PollInterval is how often the slot (pg_replication_slots) and the
	// event and dead-letter streams are polled for their gauges.
	PollInterval time.Duration `yaml:"poll_interval"`
}

// Reconcile configures the reconciliation loop inside `run`, which exports
// its differences as outbox_relay_reconcile_* metrics.
type Reconcile struct {
	// Interval between runs; 0 disables the loop.
	Interval time.Duration `yaml:"interval"`
	// Window is how far back each run looks (rows' occurred-at time).
	Window time.Duration `yaml:"window"`
}

// Postgres configures the replication source.
type Postgres struct {
	URL            string        `yaml:"url"`
	Slot           string        `yaml:"slot"`
	Publication    string        `yaml:"publication"`
	StatusInterval time.Duration `yaml:"status_interval"`
	// AutoSetup creates a missing publication and slot when run starts.
	AutoSetup bool `yaml:"auto_setup"`
	// ReceiveTimeout: silence from the server this long means a dead
	// connection (stalled network, hung server); the relay reconnects.
	ReceiveTimeout time.Duration `yaml:"receive_timeout"`
	// FailoverSlot creates a PostgreSQL 17 failover slot.
	FailoverSlot bool `yaml:"failover_slot"`
	// PublicationCheck is how often the publication is checked while the
	// relay streams (it is also checked before every session starts).
	PublicationCheck time.Duration `yaml:"publication_check_interval"`
	// Backfill publishes the rows already in the outbox (publish_state =
	// 'PENDING') when the slot is created, from the slot's exported
	// snapshot: a first install or a cut-over from a polling relay loses
	// nothing and publishes nothing twice.
	Backfill bool `yaml:"backfill"`
}

// NATS configures the JetStream side.
type NATS struct {
	URL              string        `yaml:"url"`
	Stream           string        `yaml:"stream"`
	StreamSubjects   []string      `yaml:"stream_subjects"`
	DeadLetterStream string        `yaml:"dead_letter_stream"`
	CreateStreams    bool          `yaml:"create_streams"`
	Replicas         int           `yaml:"replicas"`
	DuplicateWindow  time.Duration `yaml:"duplicate_window"`
	// MaxAge is how long a created event stream keeps an event; 0 keeps it
	// for ever. Consumers' dedup rows may be pruned only past it.
	MaxAge           time.Duration `yaml:"max_age"`
	AckTimeout       time.Duration `yaml:"ack_timeout"`
	MaxInFlight      int           `yaml:"max_in_flight"`
	MaxInFlightBytes int           `yaml:"max_in_flight_bytes"`
	// MaxUnsettledTransactions and MaxUnsettledWALBytes bound what is
	// published behind a message not yet acknowledged: at either bound
	// the relay stops reading the WAL until the watermark moves.
	MaxUnsettledTransactions int `yaml:"max_unsettled_transactions"`
	MaxUnsettledWALBytes     int `yaml:"max_unsettled_wal_bytes"`
	// StallWarning is how long the watermark may stand still before the
	// relay names the message holding it (log, metric).
	StallWarning time.Duration `yaml:"stall_warning"`
	// BatchPublish chooses how events are published: "auto" (fast-ingest
	// batches when the event stream allows them, per aggregate otherwise),
	// "on" (batches, refusing to start without them) or "off".
	BatchPublish    string `yaml:"batch_publish"`
	User            string `yaml:"user"`
	Password        string `yaml:"password"`
	CredentialsFile string `yaml:"credentials_file"`
	NKeySeedFile    string `yaml:"nkey_seed_file"`
	CAFile          string `yaml:"ca_file"`
	CertFile        string `yaml:"cert_file"`
	KeyFile         string `yaml:"key_file"`
	// RequireDurableStream refuses to run unless the event stream is
	// file-backed with at least 3 replicas.
	RequireDurableStream bool `yaml:"require_durable_stream"`
	// MaxExpectedOutage is the longest relay outage to plan for; the relay
	// warns when the stream's duplicate window is shorter.
	MaxExpectedOutage time.Duration `yaml:"max_expected_outage"`
	// Partitions, when positive, partitions the event stream for consumer
	// groups (docs/consumer.md "Consumer groups"): `setup` and created
	// streams add a subject transform appending "<P>.<partition>".
	Partitions int `yaml:"partitions"`
}

// HTTP configures the metrics and health listener.
type HTTP struct {
	// Listen is host:port; empty disables the listener.
	Listen string `yaml:"listen"`
	// Pprof exposes /debug/pprof on the listener.
	Pprof bool `yaml:"pprof"`
	// LingerOnError keeps the listener serving this long after the relay
	// stopped for a condition that needs an operator (a lost slot, bad
	// grants), so the metrics that explain it can be scraped before the
	// process exits non-zero.
	LingerOnError time.Duration `yaml:"linger_on_error"`
}

// Tracing configures OpenTelemetry tracing (README, "Tracing").
type Tracing struct {
	// RelaySpans makes the relay emit batch publish spans: a root span
	// of kind producer per batch of rows (up to 128 writer spans or 5 ms
	// of transactions), linked to each sampled writer span context among
	// them, from routing the first row to the ack of the last. Off by
	// default: the trace context headers are relayed unchanged either way.
	RelaySpans bool `yaml:"relay_spans"`
}

// Log configures logging.
type Log struct {
	Level  string `yaml:"level"`  // debug, info, warn, error
	Format string `yaml:"format"` // json or console
}

// Default returns the configuration before file, env and flags.
func Default() Config {
	return Config{
		Postgres: Postgres{
			Slot:             "outbox_relay",
			Publication:      "outbox_relay",
			StatusInterval:   replication.DefaultStatusInterval,
			AutoSetup:        true,
			ReceiveTimeout:   replication.DefaultReceiveTimeout,
			Backfill:         true,
			PublicationCheck: relay.DefaultPublicationCheck,
		},
		NATS: NATS{
			URL:                      "nats://127.0.0.1:4222",
			Stream:                   "OUTBOX",
			DeadLetterStream:         "OUTBOX_DLQ",
			CreateStreams:            true,
			Replicas:                 1,
			DuplicateWindow:          2 * time.Minute,
			AckTimeout:               publisher.DefaultAckTimeout,
			MaxInFlight:              publisher.DefaultMaxInFlight,
			MaxInFlightBytes:         publisher.DefaultMaxInFlightBytes,
			MaxUnsettledTransactions: relay.DefaultMaxUnsettledTxs,
			MaxUnsettledWALBytes:     relay.DefaultMaxUnsettledBytes,
			StallWarning:             relay.DefaultStallWarning,
			BatchPublish:             "auto",
			MaxExpectedOutage:        2 * time.Minute,
		},
		HTTP:            HTTP{Listen: "127.0.0.1:9187", LingerOnError: 15 * time.Second},
		Log:             Log{Level: "info", Format: "json"},
		ShutdownTimeout: relay.DefaultShutdownTimeout,
		Metrics:         Metrics{PollInterval: 15 * time.Second},
		Reconcile:       Reconcile{Window: time.Hour},
	}
}

var streamRE = regexp.MustCompile(`^[A-Za-z0-9_-]{1,255}$`)

// Validate checks every value and applies derived defaults (stream subjects).
func (c *Config) Validate() error {
	var errs []error
	bad := func(path, format string, args ...any) {
		errs = append(errs, &Error{Path: path, Msg: fmt.Sprintf(format, args...)})
	}
	if c.Postgres.URL == "" {
		bad("postgres.url", "is required: set it in the file, OUTBOX_RELAY_POSTGRES_URL or --postgres-url (e.g. postgres://relay@db:5432/app)")
	} else if msg := checkPostgresURL(c.Postgres.URL); msg != "" {
		bad("postgres.url", "%s", msg)
	}
	if !replication.ValidName(c.Postgres.Slot) {
		bad("postgres.slot", "%q is not a valid slot name: %s", c.Postgres.Slot, replication.NameRule)
	}
	if !replication.ValidName(c.Postgres.Publication) {
		bad("postgres.publication", "%q is not a valid publication name: %s", c.Postgres.Publication, replication.NameRule)
	}
	if c.Postgres.StatusInterval < 10*time.Millisecond || c.Postgres.StatusInterval > 30*time.Second {
		bad("postgres.status_interval", "%s is out of range: use 10ms to 30s (well below the server's wal_sender_timeout)", c.Postgres.StatusInterval)
	}
	if c.Postgres.ReceiveTimeout < replication.MinReceiveTimeout(c.Postgres.StatusInterval) {
		bad("postgres.receive_timeout", "%s must be at least 3 × postgres.status_interval (%s): status updates ask the server for a keepalive after a third of it", c.Postgres.ReceiveTimeout, c.Postgres.StatusInterval)
	}
	if c.NATS.MaxExpectedOutage < 0 {
		bad("nats.max_expected_outage", "%s is negative", c.NATS.MaxExpectedOutage)
	}
	if c.NATS.URL == "" {
		bad("nats.url", "is required: set it in the file, OUTBOX_RELAY_NATS_URL or --nats-url (e.g. nats://127.0.0.1:4222)")
	} else {
		for _, u := range strings.Split(c.NATS.URL, ",") {
			if msg := checkNATSURL(strings.TrimSpace(u)); msg != "" {
				bad("nats.url", "%s", msg)
				break
			}
		}
	}
	if !streamRE.MatchString(c.NATS.Stream) {
		bad("nats.stream", "%q is not a valid stream name: use letters, digits, _ and -", c.NATS.Stream)
	}
	if !streamRE.MatchString(c.NATS.DeadLetterStream) {
		bad("nats.dead_letter_stream", "%q is not a valid stream name: use letters, digits, _ and -", c.NATS.DeadLetterStream)
	} else if c.NATS.DeadLetterStream == c.NATS.Stream {
		bad("nats.dead_letter_stream", "must differ from nats.stream (%q): dead letters need their own stream and retention", c.NATS.Stream)
	}
	if c.NATS.Replicas < 1 || c.NATS.Replicas > 5 {
		bad("nats.replicas", "%d is out of range: use 1 to 5 (3 for durable acks in a cluster)", c.NATS.Replicas)
	}
	if c.NATS.DuplicateWindow < time.Second {
		bad("nats.duplicate_window", "%s is too short: it must exceed the longest relay outage (default 2m)", c.NATS.DuplicateWindow)
	}
	if c.NATS.MaxAge != 0 && c.NATS.MaxAge < c.NATS.DuplicateWindow {
		bad("nats.max_age", "%s is shorter than nats.duplicate_window (%s): JetStream refuses such a stream; use 0 (keep events for ever) or at least the window, and longer than any consumer may lag", c.NATS.MaxAge, c.NATS.DuplicateWindow)
	}
	if c.NATS.AckTimeout < publisher.MinAckTimeout {
		bad("nats.ack_timeout", "%s is too short: use at least %s (default %s)", c.NATS.AckTimeout, publisher.MinAckTimeout, publisher.DefaultAckTimeout)
	}
	if c.NATS.MaxInFlight < 1 || c.NATS.MaxInFlight > publisher.MaxMaxInFlight {
		bad("nats.max_in_flight", "%d is out of range: use 1 to %d (default %d)", c.NATS.MaxInFlight, publisher.MaxMaxInFlight, publisher.DefaultMaxInFlight)
	}
	if c.NATS.Partitions < 0 || c.NATS.Partitions > contract.MaxPartitions {
		bad("nats.partitions", "%d: want 0 (no consumer groups) to %d", c.NATS.Partitions, contract.MaxPartitions)
	}
	if c.NATS.MaxInFlightBytes < publisher.MinMaxInFlightBytes {
		bad("nats.max_in_flight_bytes", "%d is too small: use at least %d (default %d)", c.NATS.MaxInFlightBytes, publisher.MinMaxInFlightBytes, publisher.DefaultMaxInFlightBytes)
	}
	if c.NATS.MaxUnsettledTransactions < c.NATS.MaxInFlight {
		bad("nats.max_unsettled_transactions", "%d is below nats.max_in_flight (%d): use at least that (default %d)", c.NATS.MaxUnsettledTransactions, c.NATS.MaxInFlight, relay.DefaultMaxUnsettledTxs)
	}
	if c.NATS.MaxUnsettledWALBytes < relay.MinMaxUnsettledBytes {
		bad("nats.max_unsettled_wal_bytes", "%d is too small: use at least %d (default %d)", c.NATS.MaxUnsettledWALBytes, relay.MinMaxUnsettledBytes, relay.DefaultMaxUnsettledBytes)
	}
	if c.Postgres.PublicationCheck < relay.MinPublicationCheck {
		bad("postgres.publication_check_interval", "%s is too short: use at least %s (default %s)", c.Postgres.PublicationCheck, relay.MinPublicationCheck, relay.DefaultPublicationCheck)
	}
	if c.NATS.StallWarning < relay.MinStallWarning {
		bad("nats.stall_warning", "%s is too short: use at least %s (default %s)", c.NATS.StallWarning, relay.MinStallWarning, relay.DefaultStallWarning)
	}
	switch c.NATS.BatchPublish {
	case "auto", "on", "off":
	default:
		bad("nats.batch_publish", "%q is not a mode: use auto (default), on or off", c.NATS.BatchPublish)
	}
	if c.NATS.CredentialsFile != "" && (c.NATS.User != "" || c.NATS.NKeySeedFile != "") {
		bad("nats.credentials_file", "set only one of credentials_file, user/password and nkey_seed_file")
	}
	switch {
	case c.NATS.CertFile != "" && c.NATS.KeyFile == "":
		bad("nats.key_file", "is required with nats.cert_file: a client certificate needs its private key")
	case c.NATS.KeyFile != "" && c.NATS.CertFile == "":
		bad("nats.cert_file", "is required with nats.key_file: set the client certificate, or remove key_file")
	}
	if c.NATS.Password != "" && c.NATS.User == "" {
		bad("nats.password", "is set without nats.user: set the user too")
	}
	if c.NATS.User != "" && c.NATS.NKeySeedFile != "" {
		bad("nats.nkey_seed_file", "set only one of user/password and nkey_seed_file")
	}
	if c.HTTP.Listen != "" {
		if _, port, err := net.SplitHostPort(c.HTTP.Listen); err != nil || port == "" {
			bad("http.listen", "%q is not host:port: use e.g. 127.0.0.1:9187, or :9187 for every interface (empty disables the listener)", c.HTTP.Listen)
		}
	}
	if c.Log.Level != "" {
		switch c.Log.Level {
		case "debug", "info", "warn", "error":
		default:
			bad("log.level", "%q is not a level: use debug, info, warn or error", c.Log.Level)
		}
	}
	switch c.Log.Format {
	case "json", "console":
	default:
		bad("log.format", "%q is not a format: use json or console", c.Log.Format)
	}
	if c.ShutdownTimeout < 0 || c.ShutdownTimeout > 5*time.Minute {
		bad("shutdown_timeout", "%s is out of range: use 0 to 5m", c.ShutdownTimeout)
	}
	if c.Metrics.PollInterval < 100*time.Millisecond || c.Metrics.PollInterval > 10*time.Minute {
		bad("metrics.poll_interval", "%s is out of range: use 100ms to 10m (default 15s, the usual scrape interval)", c.Metrics.PollInterval)
	}
	if c.Reconcile.Interval != 0 && (c.Reconcile.Interval < 10*time.Second || c.Reconcile.Interval > 24*time.Hour) {
		bad("reconcile.interval", "%s is out of range: use 10s to 24h, or 0 to disable the loop (each run reads the window's rows and events)", c.Reconcile.Interval)
	}
	if c.Reconcile.Window < time.Second || c.Reconcile.Window > 31*24*time.Hour {
		bad("reconcile.window", "%s is out of range: use 1s to 744h (default 1h; memory grows with the rows in the window)", c.Reconcile.Window)
	}
	if err := c.Router.Validate(); err != nil {
		// The router joins one error per problem: convert each, so that
		// none is lost and all of them match ErrInvalid.
		for _, e := range unjoin(err) {
			var ce *router.ConfigError
			if errors.As(e, &ce) {
				errs = append(errs, &Error{Path: ce.Path, Msg: ce.Msg})
			} else {
				errs = append(errs, fmt.Errorf("%w: %w", ErrInvalid, e))
			}
		}
	} else {
		if len(c.NATS.StreamSubjects) == 0 {
			c.NATS.StreamSubjects = c.Router.SubjectFilters()
		} else {
			for _, f := range c.Router.SubjectFilters() {
				if !coveredBy(c.NATS.StreamSubjects, f) {
					bad("nats.stream_subjects", "%v do not cover %q, which the subject templates produce: add it or leave stream_subjects empty to derive them", c.NATS.StreamSubjects, f)
				}
			}
			dlq := c.Router.DeadLetterFilter()
			for _, s := range c.NATS.StreamSubjects {
				if contract.FiltersOverlap(s, dlq) {
					bad("nats.stream_subjects", "%q overlaps the dead-letter subjects %q: dead letters would land in the event stream", s, dlq)
				}
			}
		}
	}
	if c.NATS.Partitions > 0 && len(c.NATS.StreamSubjects) > 1 {
		bad("nats.partitions", "needs one stream subject to partition, have %v: use one subject template (such as the default outbox.{aggregate_type}.{aggregate_id}) for all tables", c.NATS.StreamSubjects)
	}
	if c.NATS.Partitions > 0 {
		spread := func(path, subject string, ph []string) {
			bad(path, "%q holds %s, which differs between one aggregate's events: with nats.partitions the stream hashes every subject token, so the aggregate's events would land in several partitions and lose their order for consumer groups; use only {aggregate_type}, {aggregate_id}, {table}, {schema} and literal text (e.g. the default %s), or unset nats.partitions",
				subject, strings.Join(ph, ", "), router.DefaultSubject)
		}
		for i, t := range c.Router.Tables {
			if ph := t.EventPlaceholders(); len(ph) > 0 {
				spread(fmt.Sprintf("tables[%d].subject", i), t.Subject, ph)
			}
		}
		for i, m := range c.Router.Messages {
			if ph := m.EventPlaceholders(); len(ph) > 0 {
				spread(fmt.Sprintf("messages[%d].subject", i), m.Subject, ph)
			}
		}
	}
	return errors.Join(errs...)
}

func checkPostgresURL(s string) string {
	if strings.HasPrefix(s, "postgres://") || strings.HasPrefix(s, "postgresql://") {
		u, err := url.Parse(s)
		if err != nil {
			return "is not a valid URL (check for unescaped characters in the password: percent-encode them)"
		}
		if u.Host == "" {
			return "has no host: use postgres://user@host:5432/dbname"
		}
		if strings.Trim(u.Path, "/") == "" {
			return "names no database: use postgres://user@host:5432/dbname"
		}
		return ""
	}
	if strings.Contains(s, "=") {
		return "" // key=value form; pgx reports problems with it at connect
	}
	return "is neither a postgres:// URL nor a key=value connection string"
}

func checkNATSURL(s string) string {
	u, err := url.Parse(s)
	if err != nil || u.Host == "" {
		return fmt.Sprintf("%q is not a URL: use nats://host:4222 (comma-separate several servers)", redactURL(s))
	}
	switch u.Scheme {
	case "nats", "tls", "ws", "wss":
		return ""
	}
	return fmt.Sprintf("scheme %q is not supported: use nats://, tls://, ws:// or wss://", u.Scheme)
}

// redactURL hides a password in a URL for error messages and logs.
func redactURL(s string) string {
	u, err := url.Parse(s)
	if err != nil || (u.User == nil && strings.Contains(s, "@")) {
		// An unparsable URL, or one parsed as opaque ("user:pw@host"), may
		// still hold user:password@: hide everything between the scheme
		// and the last '@'.
		if at := strings.LastIndex(s, "@"); at >= 0 {
			start := strings.Index(s, "://") + 3
			if start < 3 || start > at {
				start = 0
			}
			return s[:start] + "xxxxx" + s[at:]
		}
		return s
	}
	if u.User == nil {
		return s
	}
	if _, ok := u.User.Password(); ok {
		u.User = url.UserPassword(u.User.Username(), "xxxxx")
	}
	return u.String()
}

// RedactURL hides the password of a connection URL.
func RedactURL(s string) string { return redactURL(s) }

// unjoin returns the errors joined in err (errors.Join), or err alone.
func unjoin(err error) []error {
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		return j.Unwrap()
	}
	return []error{err}
}

func coveredBy(subjects []string, filter string) bool {
	for _, s := range subjects {
		if contract.FilterCovers(s, filter) {
			return true
		}
	}
	return false
}
