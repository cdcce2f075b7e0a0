package config_test

import (
	"testing"

	"github.com/outbox-relay/outbox-relay/internal/config"
)

// nats.partitions: a count out of range, or several stream subjects to
// partition, is refused naming the key; the count reaches the stream spec.
func TestPartitionsConfig(t *testing.T) {
	t.Parallel()
	for _, doc := range []string{
		"postgres: {url: 'postgres://relay@db/app'}\nnats: {partitions: -1}\n",
		"postgres: {url: 'postgres://relay@db/app'}\nnats: {partitions: 5000}\n",
		"postgres: {url: 'postgres://relay@db/app'}\nnats: {partitions: 4}\n" +
			"tables: [{table: public.outbox}, {table: public.other, subject: 'other.{aggregate_id}'}]\n",
	} {
		_, err := config.Load(config.Sources{File: writeConfig(t, doc)})
		found := false
		for _, ce := range configErrors(err) {
			found = found || ce.Path == "nats.partitions"
		}
		if !found {
			t.Errorf("%s: no nats.partitions error in %v", doc, err)
		}
	}
	c, err := config.Load(config.Sources{File: writeConfig(t, "postgres: {url: 'postgres://relay@db/app'}\nnats: {partitions: 8}\ntables: [{table: public.outbox}]\n")})
	if err != nil {
		t.Fatal(err)
	}
	if ev, _ := c.Streams(); ev.Partitions != 8 {
		t.Fatalf("stream spec partitions %d, want 8", ev.Partitions)
	}
}

// Issue 26: a subject template with {event_type} and nats.partitions was
// accepted, and the stream's partition transform spread one aggregate over
// partitions (order/42: Created → 8.7, Shipped → 8.4), losing its order
// for consumer groups. Refused at load, naming the table's or message
// prefix's subject; without partitions the template stays fine.
func TestPartitionsRefuseEventTypeInSubject(t *testing.T) {
	t.Parallel()
	const pg = "postgres: {url: 'postgres://relay@db/app'}\n"
	for _, tc := range []struct{ doc, path string }{
		{pg + "nats: {partitions: 8}\ntables: [{table: public.outbox, subject: 'outbox.{event_type}.{aggregate_id}'}]\n", "tables[0].subject"},
		{pg + "nats: {partitions: 8}\ntables: [{table: public.outbox, subject: 'outbox.{aggregate_type}.{aggregate_id}'}]\n" +
			"messages: [{prefix: evts, subject: 'outbox.ev-{event_type}.{aggregate_id}'}]\n", "messages[0].subject"},
	} {
		_, err := config.Load(config.Sources{File: writeConfig(t, tc.doc)})
		found := false
		for _, ce := range configErrors(err) {
			found = found || ce.Path == tc.path
		}
		if !found {
			t.Errorf("%s: no %s error in %v", tc.doc, tc.path, err)
		}
	}
	if _, err := config.Load(config.Sources{File: writeConfig(t, pg+"tables: [{table: public.outbox, subject: 'outbox.{event_type}.{aggregate_id}'}]\n")}); err != nil {
		t.Errorf("{event_type} without partitions: %v", err)
	}
	if _, err := config.Load(config.Sources{File: writeConfig(t, pg+"nats: {partitions: 8}\ntables: [{table: public.outbox, subject: 'outbox.{table}.{aggregate_type}.{aggregate_id}'}]\n")}); err != nil {
		t.Errorf("{table} with partitions: %v", err)
	}
}
