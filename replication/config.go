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
}

var identRE = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`)

func (c *Config) setDefaults() error {
	if c.URL == "" {
		return fmt.Errorf("replication: postgres URL is empty")
	}
	if !identRE.MatchString(c.Slot) {
		return fmt.Errorf("replication: slot name %q is invalid: use 1-63 lower-case letters, digits and underscores", c.Slot)
	}
	if !identRE.MatchString(c.Publication) {
		return fmt.Errorf("replication: publication name %q is invalid: use 1-63 lower-case letters, digits and underscores", c.Publication)
	}
	if c.StatusInterval <= 0 {
		c.StatusInterval = time.Second
	}
	if c.ApplicationName == "" {
		c.ApplicationName = "outbox-relay"
	}
	return nil
}
