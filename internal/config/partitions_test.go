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
