package main

import (
	"context"
	"encoding/json"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/replication"
)

// Issue 25: a publication gap recorded in outbox_relay_gap (the outbox
// table dropped from the publication while the relay streamed, the relay
// stopped before the table was added back) is shown by `status`, from
// where, since when and in what state, and `reconcile` says what it means
// for its window, and that a window starting after it does not cover it.
// Before, both ignored the table: status reported only the publication
// check, and once the table was back, nothing at all.
func TestStatusAndReconcileShowPublicationGap(t *testing.T) {
	t.Parallel()
	f := newOpsFixture(t)
	ctx := context.Background()
	if out, err := f.cli("setup"); err != nil {
		t.Fatalf("setup: %v\n%s", err, out)
	}
	stop := f.start()
	f.insert(ctx, 3, "E")
	pub := `"` + f.cfg.Postgres.Publication + `"`
	f.exec(`ALTER PUBLICATION ` + pub + ` DROP TABLE public.outbox`)
	if !testenv.WaitFor(30*time.Second, func() bool {
		g, err := replication.ReadGap(ctx, f.cfg.Replication())
		return err == nil && g.Open
	}) {
		t.Fatal("no gap recorded 30 s after the table left the publication")
	}
	_ = stop()

	out, err := f.cli("status")
	t.Logf("status, table dropped:\n%s", out)
	if err == nil || !regexp.MustCompile(`\n  publication gap +open since \S+, from \d+/[0-9A-F]+`).MatchString(out) ||
		!strings.Contains(out, "problem: publication gap open since") || !strings.Contains(out, "waiting for the publication to be fixed") {
		t.Errorf("status (%v) does not show the open gap waiting for the publication", err)
	}

	f.exec(`ALTER PUBLICATION ` + pub + ` ADD TABLE public.outbox`)
	out, err = f.cli("status", "--json")
	var rep statusReport
	if jerr := json.Unmarshal([]byte(out), &rep); jerr != nil {
		t.Fatalf("status --json: %v\n%s", jerr, out)
	}
	if err == nil || rep.PublicationGap == nil || rep.PublicationGap.SinceLSN == "" || rep.PublicationGap.NoticedAt.IsZero() ||
		!strings.Contains(rep.PublicationGap.State, "publication right again") {
		t.Errorf("status --json (%v), table back, relay stopped: gap %+v, want it open with its position, time and state", err, rep.PublicationGap)
	}

	out, _ = f.cli("reconcile", "--since", "1m", "--confirm-wait", "0")
	t.Logf("reconcile --since 1m:\n%s", out)
	for _, want := range []string{"publication gap open since", "count as pending here until it is filled", "--repair --include-pending", "This window does not cover the gap"} {
		if !strings.Contains(out, want) {
			t.Errorf("reconcile does not say %q", want)
		}
	}
	out, _ = f.cli("reconcile", "--since", "1h", "--confirm-wait", "0")
	if !strings.Contains(out, "publication gap open since") || strings.Contains(out, "does not cover the gap") {
		t.Errorf("reconcile --since 1h, which covers the gap:\n%s", out)
	}
}
