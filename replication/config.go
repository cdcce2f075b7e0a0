package replication

import (
	"fmt"
	"regexp"
	"time"
)

// Config configures the replication stage.
type Config struct {
	// URL is the PostgreSQL connection string (URL or key=value form). The
	// relay adds replication=database itself.
	URL string
	// Slot is the logical replication slot, created with the pgoutput plugin.
	Slot string
	// Publication is the publication that lists the outbox tables.
	Publication string
	// Tables are the schema-qualified outbox tables of the publication.
	Tables []string
	// StatusInterval is how often a standby status update is sent when the
	// server does not ask sooner. Default 1s; keep it well below the server's
	// wal_sender_timeout (60s by default).
	StatusInterval time.Duration
	// Messages asks pgoutput for pg_logical_emit_message records
	// (PostgreSQL 14+).
	Messages bool
	// ApplicationName identifies the relay in pg_stat_replication.
	ApplicationName string
	// ReceiveTimeout is how long the stream waits without receiving
	// anything (data or keepalive) before it treats the connection as dead.
	// Status updates ask the server for a keepalive once a third of it has
	// passed in silence, so a healthy idle server always answers in time.
	// Default 30s.
	ReceiveTimeout time.Duration
	// FailoverSlot creates the slot with failover = true (PostgreSQL 17+),
	// so it is synchronised to standbys that have sync_replication_slots on
	// and survives a promotion.
	FailoverSlot bool
}

// Defaults of Config, which the configuration file's defaults reuse.
const (
	DefaultStatusInterval  = time.Second
	DefaultReceiveTimeout  = 30 * time.Second
	DefaultApplicationName = "outbox-relay"
)

// NameRule says which slot and publication names ValidName accepts.
const NameRule = "use 1-63 lower-case letters, digits and underscores"

var identRE = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`)

// ValidName reports whether s can name a slot or a publication (NameRule):
// a PostgreSQL identifier that needs no quoting.
func ValidName(s string) bool { return identRE.MatchString(s) }

// MinReceiveTimeout is the shortest ReceiveTimeout that works with
// statusInterval: status updates ask the server for a keepalive once a
// third of the receive timeout has passed in silence, and they go out at
// most every status interval.
func MinReceiveTimeout(statusInterval time.Duration) time.Duration { return 3 * statusInterval }

func (c *Config) setDefaults() error {
	if c.URL == "" {
		return fmt.Errorf("replication: postgres URL is empty")
	}
	if !ValidName(c.Slot) {
		return fmt.Errorf("replication: slot name %q is invalid: %s", c.Slot, NameRule)
	}
	if !ValidName(c.Publication) {
		return fmt.Errorf("replication: publication name %q is invalid: %s", c.Publication, NameRule)
	}
	if c.StatusInterval <= 0 {
		c.StatusInterval = DefaultStatusInterval
	}
	if c.ReceiveTimeout <= 0 {
		c.ReceiveTimeout = DefaultReceiveTimeout
	}
	if c.ReceiveTimeout < MinReceiveTimeout(c.StatusInterval) {
		return fmt.Errorf("replication: receive timeout %s must be at least 3 status intervals (%s)", c.ReceiveTimeout, c.StatusInterval)
	}
	if c.ApplicationName == "" {
		c.ApplicationName = DefaultApplicationName
	}
	return nil
}
