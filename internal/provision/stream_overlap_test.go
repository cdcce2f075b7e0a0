package provision_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/provision"
)

// Creating a stream whose subjects another stream holds fails with an
// error that names that stream (JetStream's own says only "subjects
// overlap with an existing stream").
func TestEnsureStreamNamesTheOverlappingStream(t *testing.T) {
	nc := connectNATS(t)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "OTHER_SERVICE", Subjects: []string{"orders.>"}}); err != nil {
		t.Fatal(err)
	}
	_, err = provision.EnsureStream(ctx, js, provision.StreamSpec{Name: "OUTBOX", Subjects: []string{"orders.*.*"}, Duplicates: time.Minute}, true)
	if err == nil || !strings.Contains(err.Error(), "overlap stream OTHER_SERVICE (orders.>)") {
		t.Fatalf("EnsureStream = %v, want the overlapping stream named", err)
	}
}
