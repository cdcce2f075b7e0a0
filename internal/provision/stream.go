package provision

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/contract"
)

// StreamSpec describes a stream the relay publishes to.
type StreamSpec struct {
	Name     string
	Subjects []string
	// Duplicates is the de-duplication window. It must exceed the longest
	// relay outage: a message re-sent after the window is stored twice.
	Duplicates time.Duration
	// Replicas for a created stream; default 1.
	Replicas int
	// MaxAge of a created stream; 0 keeps messages forever.
	MaxAge time.Duration
	// MinDuplicates is the shortest acceptable duplicate window (the
	// longest expected relay outage); a shorter one is warned about.
	MinDuplicates time.Duration
	// RequireDurable refuses a stream whose acks are not durable (memory
	// storage or fewer than 3 replicas).
	RequireDurable bool
	// AllowBatch creates the stream with fast-ingest batch publishing
	// allowed (allow_batched, nats-server 2.14 or later; older servers
	// ignore it). An existing stream is never changed.
	AllowBatch bool

	// Partitions, when positive, partitions the stream for consumer groups:
	// a subject transform inserts "<Partitions>.<partition>" before every
	// subject's aggregate id (contract.PartitionTransform). A created stream gets it; an
	// existing stream without it, or with another count, is refused with
	// the fix unless UpdatePartitions (`outbox-relay setup`) lets
	// EnsureStream set it.
	Partitions       int
	UpdatePartitions bool

	// SubjectsKey names the configuration that sets Subjects, for the fix
	// when they overlap another stream's; "" names the subject templates
	// and nats.stream_subjects.
	SubjectsKey string
}

// ErrNotRead means the stream could not be read (JetStream did not answer
// in time, or answered with a failure of its own): nothing is known about
// it, right or wrong. A caller that checks streams while running keeps its
// last verdict and tries again; at start it is an error like any other.
var ErrNotRead = errors.New("could not read the stream")

// ErrNotDurable means the stream's acknowledgements do not survive a
// server crash and durable acks were required.
var ErrNotDurable = errors.New("stream acks are not durable")

// Durability says whether a stream's acks survive the loss of a server,
// and why not.
func Durability(cfg jetstream.StreamConfig) (bool, string) {
	switch {
	case cfg.Storage != jetstream.FileStorage:
		return false, "memory storage: acknowledged events are lost when the server restarts"
	case cfg.Replicas < 3:
		return false, fmt.Sprintf("%d replica(s): an acknowledged event is on one server's disk only, and JetStream acks before fsync (sync every 2 minutes by default), so a crash of that server can lose acknowledged events; use 3 replicas", cfg.Replicas)
	}
	return true, ""
}

// StreamReport says what EnsureStream found or did.
type StreamReport struct {
	Created bool
	// Partitioned says the partition transform was added or changed
	// (StreamSpec.UpdatePartitions), to the count in StreamSpec.Partitions.
	Partitioned bool
	Info        *jetstream.StreamInfo
	// Warnings are conditions an operator should know about: acks that are
	// not durable, a duplicate window shorter than requested.
	Warnings []string
	// Durable reports whether acks survive a server crash; DurableReason
	// says why not.
	Durable       bool
	DurableReason string
}

// EnsureStream checks that the stream exists and its subjects cover every
// subject in spec.Subjects; with create it creates a missing stream (file
// storage) first. It never changes an existing stream.
func EnsureStream(ctx context.Context, js jetstream.JetStream, spec StreamSpec, create bool) (*StreamReport, error) {
	rep := &StreamReport{}
	s, err := js.Stream(ctx, spec.Name)
	if err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil, fmt.Errorf("%w %s: %w", ErrNotRead, spec.Name, err)
	}
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		if !create {
			return nil, fmt.Errorf("stream %s does not exist: run `outbox-relay setup` or set nats.create_streams", spec.Name)
		}
		cfg := jetstream.StreamConfig{
			Name:       spec.Name,
			Subjects:   spec.Subjects,
			Storage:    jetstream.FileStorage,
			Duplicates: spec.Duplicates,
			Replicas:   max(spec.Replicas, 1),
			MaxAge:     spec.MaxAge,
			Retention:  jetstream.LimitsPolicy,
			Discard:    jetstream.DiscardOld,

			AllowBatchPublish: spec.AllowBatch,
		}
		if spec.Partitions > 0 {
			if cfg.SubjectTransform, err = partitionTransform(spec); err != nil {
				return nil, err
			}
		}
		s, err = js.CreateStream(ctx, cfg)
		var apiErr *jetstream.APIError
		switch {
		case errors.Is(err, jetstream.ErrStreamNameAlreadyInUse):
			s, err = js.Stream(ctx, spec.Name)
		case errors.As(err, &apiErr) && apiErr.ErrorCode == errCodeSubjectsOverlap:
			return nil, overlapError(ctx, js, spec, err)
		case err == nil:
			rep.Created = true
		}
	}
	if err != nil {
		return nil, fmt.Errorf("stream %s: %w", spec.Name, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("%w %s: %w", ErrNotRead, spec.Name, err)
	}
	for _, want := range spec.Subjects {
		if !coveredByAny(info.Config.Subjects, want) {
			return nil, fmt.Errorf("stream %s subjects %v do not cover %q: add it to the stream's subjects or change the subject template", spec.Name, info.Config.Subjects, want)
		}
	}
	if spec.Partitions > 0 {
		if info, err = ensurePartitions(ctx, js, spec, info, rep); err != nil {
			return nil, err
		}
	}
	rep.Info = info
	warnings, err := CheckShape(info.Config)
	if err != nil {
		return nil, err
	}
	rep.Warnings = append(rep.Warnings, warnings...)
	rep.Durable, rep.DurableReason = Durability(info.Config)
	if !rep.Durable {
		if spec.RequireDurable {
			return nil, fmt.Errorf("%w: stream %s: %s (nats.require_durable_stream is set: recreate the stream with file storage and 3 replicas, or unset it)", ErrNotDurable, spec.Name, rep.DurableReason)
		}
		rep.Warnings = append(rep.Warnings, fmt.Sprintf("stream %s acks are not durable: %s", spec.Name, rep.DurableReason))
	}
	minDup := max(spec.MinDuplicates, spec.Duplicates)
	if minDup > 0 && info.Config.Duplicates < minDup {
		rep.Warnings = append(rep.Warnings, fmt.Sprintf("stream %s duplicate window %s is shorter than %s (nats.max_expected_outage/duplicate_window): a relay outage longer than %s can store events twice", spec.Name, info.Config.Duplicates, minDup, info.Config.Duplicates))
	}
	return rep, nil
}

// errCodeSubjectsOverlap is JetStream's "subjects overlap with an existing
// stream" (nats.go exports no constant for it).
const errCodeSubjectsOverlap jetstream.ErrorCode = 10065

// overlapError names the streams whose subjects overlap spec's: JetStream
// says only that some stream does.
func overlapError(ctx context.Context, js jetstream.JetStream, spec StreamSpec, err error) error {
	var others []string
	names := js.StreamNames(ctx)
	for name := range names.Name() {
		s, serr := js.Stream(ctx, name)
		if serr != nil {
			continue
		}
		for _, theirs := range s.CachedInfo().Config.Subjects {
			if overlapsAny(spec.Subjects, theirs) {
				others = append(others, fmt.Sprintf("%s (%s)", name, theirs))
				break
			}
		}
	}
	if len(others) == 0 {
		return fmt.Errorf("create stream %s with subjects %v: %w", spec.Name, spec.Subjects, err)
	}
	key := spec.SubjectsKey
	if key == "" {
		key = "the subject template and nats.stream_subjects"
	}
	return fmt.Errorf("create stream %s with subjects %v: they overlap stream %s, and a subject can belong to one stream only: use that stream (nats.stream), or change %s: %w",
		spec.Name, spec.Subjects, strings.Join(others, ", "), key, err)
}

func overlapsAny(subjects []string, other string) bool {
	for _, s := range subjects {
		if contract.FiltersOverlap(s, other) {
			return true
		}
	}
	return false
}

func coveredByAny(streamSubjects []string, filter string) bool {
	for _, s := range streamSubjects {
		if contract.FilterCovers(s, filter) {
			return true
		}
	}
	return false
}
