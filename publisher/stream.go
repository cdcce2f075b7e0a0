package publisher

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
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
}

// StreamReport says what EnsureStream found or did.
type StreamReport struct {
	Created bool
	Info    *jetstream.StreamInfo
	// Warnings are conditions an operator should know about: acks that are
	// not durable, a duplicate window shorter than requested.
	Warnings []string
}

// EnsureStream checks that the stream exists and its subjects cover every
// subject in spec.Subjects; with create it creates a missing stream (file
// storage) first. It never changes an existing stream.
func EnsureStream(ctx context.Context, js jetstream.JetStream, spec StreamSpec, create bool) (*StreamReport, error) {
	rep := &StreamReport{}
	s, err := js.Stream(ctx, spec.Name)
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
		}
		s, err = js.CreateStream(ctx, cfg)
		if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
			s, err = js.Stream(ctx, spec.Name)
		} else if err == nil {
			rep.Created = true
		}
	}
	if err != nil {
		return nil, fmt.Errorf("stream %s: %w", spec.Name, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("stream %s info: %w", spec.Name, err)
	}
	rep.Info = info
	for _, want := range spec.Subjects {
		if !coveredByAny(info.Config.Subjects, want) {
			return nil, fmt.Errorf("stream %s subjects %v do not cover %q: add it to the stream's subjects or change the subject template", spec.Name, info.Config.Subjects, want)
		}
	}
	if info.Config.Storage != jetstream.FileStorage {
		rep.Warnings = append(rep.Warnings, fmt.Sprintf("stream %s uses memory storage: acknowledged events are lost when the server restarts", spec.Name))
	}
	if spec.Duplicates > 0 && info.Config.Duplicates < spec.Duplicates {
		rep.Warnings = append(rep.Warnings, fmt.Sprintf("stream %s duplicate window %s is shorter than the configured %s: a relay outage longer than %s can store events twice", spec.Name, info.Config.Duplicates, spec.Duplicates, info.Config.Duplicates))
	}
	return rep, nil
}

func coveredByAny(streamSubjects []string, filter string) bool {
	for _, s := range streamSubjects {
		if SubjectCovers(s, filter) {
			return true
		}
	}
	return false
}

// SubjectCovers reports whether every subject matching filter also matches
// the stream subject s (both may hold * and > wildcards).
func SubjectCovers(s, filter string) bool {
	st := strings.Split(s, ".")
	ft := strings.Split(filter, ".")
	for i, tok := range st {
		if tok == ">" {
			return i < len(ft)
		}
		if i >= len(ft) {
			return false
		}
		switch {
		case tok == "*":
			if ft[i] == ">" {
				return false
			}
		case ft[i] == "*" || ft[i] == ">":
			return false
		case tok != ft[i]:
			return false
		}
	}
	return len(st) == len(ft)
}
