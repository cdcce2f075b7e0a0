package provision_test

import (
	"testing"

	"github.com/nats-io/nats.go"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// connectNATS starts a NATS server of the test's own and connects to it.
func connectNATS(t *testing.T) *nats.Conn {
	t.Helper()
	if testing.Short() {
		t.Skip("needs a NATS server")
	}
	t.Parallel()
	srv, err := testenv.StartNATS()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Close)
	nc, err := nats.Connect(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return nc
}
