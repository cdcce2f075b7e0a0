package failover

import (
	"os"
	"testing"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

func TestMain(m *testing.M) { os.Exit(testenv.Main(m)) }
