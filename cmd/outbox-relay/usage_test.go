package main

import (
	"bytes"
	"context"
	"errors"
	"io"
	"strings"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// teardown without --yes is a usage error (exit 2) that says what to do,
// not an "invalid configuration".
func TestTeardownWithoutYes(t *testing.T) {
	root := newRootCmd()
	root.SetArgs([]string{"teardown"})
	root.SetOut(io.Discard)
	root.SetErr(io.Discard)
	err := root.Execute()
	var usage usageError
	if !errors.As(err, &usage) || errors.Is(err, config.ErrInvalid) || !strings.Contains(err.Error(), "re-run with --yes") {
		t.Fatalf("teardown = %v, want a usage error naming --yes", err)
	}
}

// `dlq --relay list` needs only NATS: without a configuration file (so no
// postgres.url and no tables) it lists the dead-letter stream instead of
// complaining about keys it does not use.
func TestDLQRelayListWithoutConfig(t *testing.T) {
	env := testenv.Get(t)
	nc, err := nats.Connect(env.NATS.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	stream := strings.ToUpper(testenv.UniqueName("DLQ"))
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{strings.ToLower(stream) + ".>"}}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = js.DeleteStream(context.Background(), stream) })
	t.Setenv("OUTBOX_RELAY_NATS_DEAD_LETTER_STREAM", stream)
	t.Setenv("OUTBOX_RELAY_POSTGRES_URL", "")
	root := newRootCmd()
	var out bytes.Buffer
	root.SetArgs([]string{"dlq", "--relay", "list", "--nats-url", env.NATS.URL})
	root.SetOut(&out)
	root.SetErr(&out)
	if err := root.Execute(); err != nil {
		t.Fatalf("dlq --relay list: %v\n%s", err, out.String())
	}
}
