package config

import (
	"github.com/outbox-relay/outbox-relay/internal/provision"
	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/router"
)

// Tables returns the schema-qualified outbox tables (the publication's).
func (c *Config) Tables() []string {
	var out []string
	for _, t := range c.Router.Tables {
		out = append(out, router.QualifiedTable(t.Table))
	}
	return out
}

// Replication returns the replication stage's config.
func (c *Config) Replication() replication.Config {
	return replication.Config{
		URL:            c.Postgres.URL,
		Slot:           c.Postgres.Slot,
		Publication:    c.Postgres.Publication,
		Tables:         c.Tables(),
		StatusInterval: c.Postgres.StatusInterval,
		ReceiveTimeout: c.Postgres.ReceiveTimeout,
		FailoverSlot:   c.Postgres.FailoverSlot,
	}
}

// Streams returns the specs of the event and dead-letter streams.
func (c *Config) Streams() (events, deadLetters provision.StreamSpec) {
	events = provision.StreamSpec{
		Name:       c.NATS.Stream,
		Subjects:   c.NATS.StreamSubjects,
		Duplicates: c.NATS.DuplicateWindow,
		MaxAge:     c.NATS.MaxAge,
		Replicas:   c.NATS.Replicas,
		// The dedup window must cover the longest outage: warn below it.
		MinDuplicates:  c.NATS.MaxExpectedOutage,
		RequireDurable: c.NATS.RequireDurableStream,
		AllowBatch:     c.NATS.BatchPublish != "off",
		Partitions:     c.NATS.Partitions,
	}
	deadLetters = provision.StreamSpec{
		Name:       c.NATS.DeadLetterStream,
		Subjects:   []string{c.Router.DeadLetterFilter()},
		Duplicates: c.NATS.DuplicateWindow,
		Replicas:   c.NATS.Replicas,
		// Its subjects are dead_letter_subject's, whatever the events use.
		SubjectsKey: "dead_letter_subject",
	}
	return events, deadLetters
}

// Relay returns the relay's config.
func (c *Config) Relay() relay.Config {
	events, dlq := c.Streams()
	return relay.Config{
		Replication: c.Replication(),
		Router:      c.Router,
		Publisher: publisher.Config{
			MaxInFlight:      c.NATS.MaxInFlight,
			MaxInFlightBytes: c.NATS.MaxInFlightBytes,
			AckTimeout:       c.NATS.AckTimeout,
		},
		Stream:            events,
		DeadLetterStream:  dlq,
		CreateStreams:     c.NATS.CreateStreams,
		BatchPublish:      c.NATS.BatchPublish,
		ShutdownTimeout:   c.ShutdownTimeout,
		MaxUnsettledTxs:   c.NATS.MaxUnsettledTransactions,
		MaxUnsettledBytes: int64(c.NATS.MaxUnsettledWALBytes),
		StallWarning:      c.NATS.StallWarning,
		PublicationCheck:  c.Postgres.PublicationCheck,
	}
}
