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

// failoverStatus checks whether a failover now would keep the slot and adds
// each reason it would not to problems, so that `status` exits 1.
func failoverStatus(ctx context.Context, cfg config.Config, problems []string) (*replication.FailoverReport, []string) {
	rep, err := replication.CheckFailover(ctx, cfg.Postgres.URL, cfg.Postgres.Slot)
	if err != nil {
		return nil, append(problems, "failover check: "+err.Error())
	}
	for _, p := range rep.Problems {
		problems = append(problems, "a failover now would lose the slot: "+p)
	}
	return &rep, problems
}

// printFailover prints the failover section of `status`.
func printFailover(w io.Writer, r *replication.FailoverReport) {
	if r == nil {
		return
	}
	fmt.Fprintf(w, "failover\t\n")
	switch {
	case r.Standbys == 0 && len(r.Checked) == 0:
		fmt.Fprintf(w, "  standbys\tnone: no failover possible\n")
		return
	case r.AtRisk():
		fmt.Fprintf(w, "  safe now\tno (%d standbys): see the problems below\n", r.Standbys)
	case r.Unverified != "":
		fmt.Fprintf(w, "  safe now\tunverified (%d standbys): %s\n", r.Standbys, r.Unverified)
	default:
		fmt.Fprintf(w, "  safe now\tyes (%d standbys)\n", r.Standbys)
	}
	for _, s := range r.Checked {
		if s.Ready {
			fmt.Fprintf(w, "  %s\tslot synchronised, failover-ready\n", s.Host)
		} else {
			fmt.Fprintf(w, "  %s\t%s\n", s.Host, s.Problem)
		}
	}
}
