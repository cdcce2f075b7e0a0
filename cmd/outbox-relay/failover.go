package main

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/replication"
)

// refuseSlotLostInFailover keeps auto_setup from creating a slot on a
// server promoted from a standby when the event stream already holds
// events: the old primary's slot did not survive the failover, and a new
// slot would start after the gap (or, with backfill, republish the whole
// table). The relay stops with the recovery instead, on every restart,
// until an operator runs it (`outbox-relay setup` is not refused).
func refuseSlotLostInFailover(ctx context.Context, cfg config.Config, nc *nats.Conn) error {
	return replication.CheckSlotNotLost(ctx, cfg.Postgres.URL, cfg.Postgres.Slot, func(ctx context.Context) (bool, error) {
		js, err := jetstream.New(nc)
		if err != nil {
			return false, err
		}
		s, err := js.Stream(ctx, cfg.NATS.Stream)
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			return false, nil
		}
		if err != nil {
			return false, err
		}
		info, err := s.Info(ctx)
		if err != nil {
			return false, err
		}
		return info.State.LastSeq > 0, nil
	})
}

// failoverRunbook is where status sends an operator whose failover would
// lose the slot for good (PostgreSQL 16 or older).
const failoverRunbook = "https://github.com/outbox-relay/outbox-relay/blob/main/docs/operations.md#primary-failover-on-postgresql-16-or-older"

// failoverStatus checks whether a failover now would lose the slot. A
// reason a setting fixes is a problem, so that `status` exits 1; on
// PostgreSQL 16 or older, where every failover loses the slot and only an
// upgrade helps, the risk is a warning with the runbook: a status that
// fails for good is one nobody reads.
func failoverStatus(ctx context.Context, cfg config.Config, problems, warnings []string) (*replication.FailoverReport, []string, []string) {
	rep, err := replication.CheckFailover(ctx, cfg.Postgres.URL, cfg.Postgres.Slot)
	if err != nil {
		return nil, append(problems, "failover check: "+err.Error()), warnings
	}
	p, w := failoverFindings(rep)
	return &rep, append(problems, p...), append(warnings, w...)
}

// failoverFindings sorts the report's reasons into problems and warnings
// (failoverStatus).
func failoverFindings(rep replication.FailoverReport) (problems, warnings []string) {
	for _, p := range rep.Problems {
		if rep.PrimaryVersion < replication.VersionFailoverSlots {
			warnings = append(warnings, "a failover now would lose the slot: "+p+"; runbook: "+failoverRunbook)
			continue
		}
		problems = append(problems, "a failover now would lose the slot: "+p)
	}
	return problems, warnings
}

// printFailover prints the failover section of `status`, its verdict on
// the heading's line.
func printFailover(w io.Writer, r *replication.FailoverReport) {
	if r == nil {
		return
	}
	switch {
	case r.Standbys == 0 && len(r.Checked) == 0:
		fmt.Fprintf(w, "failover\tno standby: no failover possible\n")
		return
	case r.AtRisk():
		fmt.Fprintf(w, "failover\tnot safe now (%d standbys): a failover would lose the slot, see below\n", r.Standbys)
	case r.Unverified != "":
		fmt.Fprintf(w, "failover\tunverified (%d standbys): %s\n", r.Standbys, r.Unverified)
	default:
		fmt.Fprintf(w, "failover\tsafe now (%d standbys)\n", r.Standbys)
	}
	for _, s := range r.Checked {
		if s.Ready {
			fmt.Fprintf(w, "  %s\tslot synchronised, failover-ready\n", s.Host)
		} else {
			fmt.Fprintf(w, "  %s\t%s\n", s.Host, s.Problem)
		}
	}
}
