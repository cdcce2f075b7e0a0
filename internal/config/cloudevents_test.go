package config_test

import (
	"os"
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/router"
)

// TestReadmeCloudEventsExample loads the README's CloudEvents example (its
// first yaml block) and checks that both the table and the message prefix
// reach the router with CloudEvents on and their sources.
func TestReadmeCloudEventsExample(t *testing.T) {
	t.Parallel()
	b, err := os.ReadFile(repoFile("README.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, sec, ok := strings.Cut(string(b), "\n## CloudEvents\n")
	_, block, ok2 := strings.Cut(sec, "```yaml\n")
	block, _, ok3 := strings.Cut(block, "```")
	if !ok || !ok2 || !ok3 {
		t.Fatal("README has no CloudEvents section with a yaml block")
	}
	c, err := config.Load(config.Sources{File: writeConfig(t, pg+block)})
	if err != nil {
		t.Fatalf("the README example does not load: %v", err)
	}
	rc := c.Relay().Router
	wantTable := router.CloudEventsConfig{Enabled: true, Source: "/outbox-relay/shop/public.outbox"}
	if len(rc.Tables) != 1 || rc.Tables[0].Table != "public.outbox" || rc.Tables[0].CloudEvents != wantTable {
		t.Errorf("router tables %+v, want public.outbox with cloudevents %+v", rc.Tables, wantTable)
	}
	wantMsg := router.CloudEventsConfig{Enabled: true, Source: "/outbox-relay/pg_logical_message.outbox_events"}
	if len(rc.Messages) != 1 || rc.Messages[0].Prefix != "outbox_events" || rc.Messages[0].CloudEvents != wantMsg {
		t.Errorf("router messages %+v, want outbox_events with cloudevents %+v", rc.Messages, wantMsg)
	}
}
