package group

import (
	"os"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

func TestMain(m *testing.M) { os.Exit(testenv.Main(m)) }

// fixture is a JetStream connection to the package's shared test server.
type fixture struct{ js jetstream.JetStream }

func newFixture(t *testing.T) *fixture {
	t.Helper()
	nc, err := nats.Connect(testenv.Get(t).NATS.URL)
	testenv.Must(t, err, "connect to nats")
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	testenv.Must(t, err, "jetstream")
	return &fixture{js: js}
}
