package main

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/replication"
)

// gapStatus is a recorded publication gap (replication.GapTable) as status
// and reconcile show it: rows the publication may have withheld from the
// slot, which the relay that streams the slot next publishes from the
// outbox tables before it streams.
type gapStatus struct {
	// SinceLSN is the slot's confirm limit when the gap was found: the
	// slot is confirmed no further until the gap is filled.
	SinceLSN  string    `json:"since_lsn"`
	NoticedAt time.Time `json:"noticed_at"`
	// Undecodable: the publication was dropped and created again; after
	// the fill the slot is advanced past the WAL it cannot decode.
	Undecodable bool   `json:"undecodable,omitempty"`
	State       string `json:"state"`
}

// gapWindowMargin is how far before a gap was noticed its rows may date:
// the check before the one that found it (publication_check, 1 s by
// default), clock skew between the producers and the database, and the
// time a transaction took to commit.
const gapWindowMargin = 5 * time.Minute

// readGapStatus reads the slot's recorded gap; nil when none is recorded.
func readGapStatus(ctx context.Context, cfg config.Config) (*gapStatus, error) {
	g, err := replication.ReadGap(ctx, cfg.Replication())
	if err != nil || !g.Open {
		return nil, err
	}
	gs := &gapStatus{SinceLSN: g.Since.String(), NoticedAt: g.NoticedAt, Undecodable: g.Undecodable}
	err = replication.CheckPublication(ctx, cfg.Replication())
	switch {
	case replication.IsPublicationProblem(err):
		gs.State = "waiting for the publication to be fixed: " + err.Error()
	case err != nil:
		gs.State = "unknown: the publication could not be checked: " + err.Error()
	default:
		gs.State = "publication right again: the relay that streams the slot next publishes the outbox rows the stream lacks, in aggregate order, before it streams (a running relay, within a publication check)"
	}
	if g.Undecodable {
		gs.State += "; the publication was dropped and created again, so the slot is then advanced past the WAL it cannot decode"
	}
	return gs, nil
}

// problem is the gap as status reports it.
func (g *gapStatus) problem() string {
	return fmt.Sprintf("publication gap open since %s (the slot is confirmed no further than %s until it is filled): outbox rows written since may be missing from the stream; %s",
		g.NoticedAt.UTC().Format(time.RFC3339), g.SinceLSN, g.State)
}

// windowStart is the earliest occurred_at the gap's rows may have.
func (g *gapStatus) windowStart() time.Time {
	return g.NoticedAt.Add(-gapWindowMargin).UTC().Truncate(time.Minute)
}

// printReconcileGap says what an open gap means for a reconciliation
// whose window starts at since.
func printReconcileGap(w io.Writer, g *gapStatus, since time.Time) {
	fmt.Fprintf(w, "\nA %s\n", g.problem())
	fmt.Fprintf(w, "Its rows count as pending here until it is filled: the relay fills it on its own once the publication is right. If no relay will run again, stop every relay and run `outbox-relay reconcile --since %s --repair --include-pending`.\n",
		g.windowStart().Format(time.RFC3339))
	if since.After(g.windowStart()) {
		fmt.Fprintf(w, "This window does not cover the gap: it starts at %s, after %s (%s before the gap was noticed); reconcile with --since %s to check its rows.\n",
			since.UTC().Format(time.RFC3339), g.windowStart().Format(time.RFC3339), gapWindowMargin, g.windowStart().Format(time.RFC3339))
	}
}
