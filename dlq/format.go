package dlq

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"
)

func (st *cmdState) json(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func (st *cmdState) printList(w io.Writer, recs []Record) error {
	for i := range recs {
		recs[i].Owner = st.owner(recs[i].Consumer, recs[i].Owner)
	}
	if st.output == "json" {
		return st.json(w, recs)
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tCONSUMER\tOWNER\tCLASS\tSTATUS\tEVENT\tAGGREGATE\tVERSION\tATTEMPTS\tAGE\tREASON")
	now := st.deps.Now()
	for _, r := range recs {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%d\t%s\t%s\n", r.ID, r.Consumer, r.Owner, r.Class, r.Status,
			dash(r.EventType), aggregate(r.AggregateType, r.AggregateID), version(r.AggregateVersion), r.Attempts,
			age(now, r.DeadLetteredAt), oneLine(r.Reason, 80))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := fmt.Fprintf(w, "%d dead letter(s)\n", len(recs))
	return err
}

func (st *cmdState) printRecord(w io.Writer, r Record) error {
	r.Owner = st.owner(r.Consumer, r.Owner)
	if st.output == "json" {
		return st.json(w, r)
	}
	tw := tabwriter.NewWriter(w, 0, 4, 1, ' ', 0)
	row := func(k string, v any) { fmt.Fprintf(tw, "%s:\t%v\n", k, v) }
	row("id", r.ID)
	row("consumer", r.Consumer)
	row("owner", r.Owner)
	row("status", r.Status)
	row("failure class", r.Class)
	row("attempts", r.Attempts)
	row("deliveries", r.Deliveries)
	row("first failed", r.FirstFailedAt.UTC().Format(time.RFC3339Nano))
	row("last failed", r.LastFailedAt.UTC().Format(time.RFC3339Nano))
	row("dead-lettered", r.DeadLetteredAt.UTC().Format(time.RFC3339Nano))
	row("event id", dash(r.EventID))
	row("event type", dash(r.EventType))
	row("aggregate", aggregate(r.AggregateType, r.AggregateID))
	row("version", version(r.AggregateVersion))
	row("subject", r.Subject)
	row("stream", fmt.Sprintf("%s sequence %d", r.Stream, r.StreamSeq))
	if r.ReplayRequestedBy != nil {
		row("replay requested", fmt.Sprintf("%s by %s (%d replays so far)", r.ReplayRequestedAt.UTC().Format(time.RFC3339), *r.ReplayRequestedBy, r.ReplayCount))
	}
	if r.ReplayOutcome != nil {
		row("replay outcome", *r.ReplayOutcome)
	}
	if r.ResolvedAt != nil {
		who, why := "", ""
		if r.ResolvedBy != nil {
			who = *r.ResolvedBy
		}
		if r.ResolutionReason != nil {
			why = ": " + *r.ResolutionReason
		}
		row("resolved", fmt.Sprintf("%s by %s%s", r.ResolvedAt.UTC().Format(time.RFC3339), who, why))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(w, "reason:\n%s\n", indent(r.Reason))
	printHeaders(w, r.Headers)
	fmt.Fprintf(w, "payload (%d bytes):\n%s\n", len(r.Payload), indent(renderPayload(r.Payload)))
	return nil
}

func (st *cmdState) printRelayList(w io.Writer, stream string, recs []RelayRecord) error {
	owner := st.owner(RelayOwnerKey, "")
	if st.output == "json" {
		return st.json(w, map[string]any{"stream": stream, "owner": owner, "records": recs})
	}
	fmt.Fprintf(w, "relay dead-letter stream %s, owner %s\n", stream, owner)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "SEQ\tCLASS\tTABLE\tLSN\tCOMMIT LSN\tAGE\tREASON")
	now := st.deps.Now()
	for _, r := range recs {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\t%s\n", r.Seq, dash(r.ReasonClass), dash(r.Table), dash(r.LSN),
			dash(r.CommitLSN), age(now, r.Time), oneLine(r.Reason, 80))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := fmt.Fprintf(w, "%d dead letter(s)\n", len(recs))
	return err
}

func (st *cmdState) printRelayRecord(w io.Writer, stream string, r RelayRecord) error {
	owner := st.owner(RelayOwnerKey, "")
	if st.output == "json" {
		return st.json(w, map[string]any{"stream": stream, "owner": owner, "record": r})
	}
	tw := tabwriter.NewWriter(w, 0, 4, 1, ' ', 0)
	row := func(k string, v any) { fmt.Fprintf(tw, "%s:\t%v\n", k, v) }
	row("stream", fmt.Sprintf("%s sequence %d", stream, r.Seq))
	row("owner", owner)
	row("subject", r.Subject)
	row("stored", r.Time.UTC().Format(time.RFC3339Nano))
	row("table", dash(r.Table))
	row("reason class", dash(r.ReasonClass))
	row("lsn", dash(r.LSN))
	row("commit lsn", dash(r.CommitLSN))
	row("commit time", dash(r.CommitTime))
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(w, "reason:\n%s\n", indent(r.Reason))
	printHeaders(w, r.Header)
	fmt.Fprintf(w, "body:\n%s\n", indent(renderPayload(r.Body)))
	return nil
}

func (st *cmdState) printAudit(w io.Writer, entries []AuditEntry) error {
	if st.output == "json" {
		return st.json(w, entries)
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "AT\tACTOR\tACTION\tQUEUE\tRECORD\tEVENT\tREASON\tRECORD FAILURE")
	for _, e := range entries {
		var d struct {
			Class  string `json:"failure_class"`
			RClass string `json:"reason_class"`
			Reason string `json:"reason"`
		}
		_ = json.Unmarshal(e.Detail, &d)
		failure := strings.TrimSpace(d.Class + d.RClass + ": " + oneLine(d.Reason, 50))
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%s\t%s\t%s\n", e.At.UTC().Format(time.RFC3339), e.Actor, e.Action, e.Queue,
			e.Record, dash(e.EventID), dash(oneLine(e.Reason, 60)), failure)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := fmt.Fprintf(w, "%d audit entr%s\n", len(entries), map[bool]string{true: "y", false: "ies"}[len(entries) == 1])
	return err
}

func printHeaders(w io.Writer, h map[string][]string) {
	keys := make([]string, 0, len(h))
	for k := range h {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	fmt.Fprintln(w, "headers:")
	for _, k := range keys {
		for _, v := range h[k] {
			fmt.Fprintf(w, "  %s: %s\n", k, v)
		}
	}
}

// renderPayload shows JSON indented, other text as it is, and binary data
// in base64.
func renderPayload(p []byte) string {
	var buf bytes.Buffer
	if json.Indent(&buf, p, "", "  ") == nil {
		return buf.String()
	}
	if utf8.Valid(p) {
		return string(p)
	}
	return "base64:" + base64.StdEncoding.EncodeToString(p)
}

func indent(s string) string { return "  " + strings.ReplaceAll(s, "\n", "\n  ") }

func oneLine(s string, n int) string {
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		s = s[:i]
	}
	if utf8.RuneCountInString(s) > n {
		r := []rune(s)
		s = string(r[:n-1]) + "…"
	}
	return s
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func aggregate(typ string, id *string) string {
	if id == nil {
		return "-"
	}
	if typ == "" {
		return *id
	}
	return typ + "/" + *id
}

func version(v *int64) string {
	if v == nil {
		return "-"
	}
	return fmt.Sprint(*v)
}

func age(now, t time.Time) string {
	d := now.Sub(t)
	switch {
	case d < time.Minute:
		return d.Round(time.Second).String()
	case d < time.Hour:
		return d.Round(time.Minute).String()
	default:
		return d.Round(time.Hour).String()
	}
}
