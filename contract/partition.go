package contract

import (
	"fmt"
	"strconv"
	"strings"
)

// Partitioned subjects. A stream that serves consumer groups stores each
// event under its published subject with two tokens inserted before the
// subject's last wildcard token (the aggregate id in the default template
// outbox.{aggregate_type}.{aggregate_id}): the partition count P and the
// event's partition p = hash(wildcard tokens) mod P, computed by
// JetStream's own subject transform {{partition(P,…)}}:
//
//	outbox.*.*  →  outbox.{{wildcard(1)}}.P.{{partition(P,1,2)}}.{{wildcard(2)}}
//	outbox.registration.42  is stored as  outbox.registration.8.3.42
//
// Every event of one aggregate lands in one partition. Keeping P in the
// subject lets a partition-count change start a new set of subjects while
// the old set drains (see docs/consumer.md "Changing the number of
// partitions").
//
// Why there and not at the end: a partition durable's filter is then
// outbox.*.8.3.* — literal tokens before the aggregate ids — so the
// server finds a partition's messages by walking the few aggregate types
// and one partition's ids. With the tokens last (outbox.*.*.8.3) every
// pull made the server match the filter against every aggregate's subject
// (bench/README.md "Consumer groups"). Filters by aggregate type such as
// outbox.registration.> still match the stored subjects.

// MaxPartitions bounds the partition count: each partition is one durable
// consumer per group.
const MaxPartitions = 1024

// slot splits a partitionable stream subject into tokens and returns the
// index of its last '*' token, where the partition tokens go.
func slot(source string) (toks []string, at int, err error) {
	toks = strings.Split(source, ".")
	at = -1
	for i, t := range toks {
		switch t {
		case ">":
			return nil, 0, fmt.Errorf("stream subject %q ends in '>': partitioning needs the aggregate's tokens as '*' wildcards (e.g. outbox.*.*), so list the subjects without '>'", source)
		case "*":
			at = i
		}
	}
	if at < 0 {
		return nil, 0, fmt.Errorf("stream subject %q has no '*' token to partition by: use a subject with the aggregate's type and id as wildcards (e.g. outbox.*.*)", source)
	}
	return toks, at, nil
}

func checkCount(partitions int) error {
	if partitions < 1 || partitions > MaxPartitions {
		return fmt.Errorf("partition count %d: want 1 to %d", partitions, MaxPartitions)
	}
	return nil
}

// PartitionTransform returns the destination of the stream subject
// transform that partitions the subjects matching source into partitions.
// source must hold at least one '*' token and no '>': the '*' tokens are
// what the partition is computed from.
func PartitionTransform(source string, partitions int) (string, error) {
	if err := checkCount(partitions); err != nil {
		return "", err
	}
	toks, at, err := slot(source)
	if err != nil {
		return "", err
	}
	var idx []string
	for _, t := range toks {
		if t == "*" {
			idx = append(idx, strconv.Itoa(len(idx)+1))
		}
	}
	dst := make([]string, 0, len(toks)+2)
	w := 0
	for i, t := range toks {
		if i == at {
			n := strconv.Itoa(partitions)
			dst = append(dst, n, "{{partition("+n+","+strings.Join(idx, ",")+")}}")
		}
		if t == "*" {
			w++
			t = "{{wildcard(" + strconv.Itoa(w) + ")}}"
		}
		dst = append(dst, t)
	}
	return strings.Join(dst, "."), nil
}

// TransformPartitions returns the partition count of a subject transform
// of source made by PartitionTransform, or 0 if destination is not one
// (another transform, or the layout of an earlier version).
func TransformPartitions(source, destination string) int {
	_, rest, ok := strings.Cut(destination, "{{partition(")
	if !ok {
		return 0
	}
	digits, _, ok := strings.Cut(rest, ",")
	if !ok {
		return 0
	}
	n, err := strconv.Atoi(digits)
	if err != nil {
		return 0
	}
	if want, err := PartitionTransform(source, n); err != nil || want != destination {
		return 0
	}
	return n
}

// PartitionFilter is the subject filter of partition p of partitions over
// stream subject source.
func PartitionFilter(source string, partitions, p int) string {
	toks, at, err := slot(source)
	if err != nil {
		return source // not partitionable; checked where the transform is made
	}
	out := make([]string, 0, len(toks)+2)
	out = append(out, toks[:at]...)
	out = append(out, strconv.Itoa(partitions), strconv.Itoa(p))
	out = append(out, toks[at:]...)
	return strings.Join(out, ".")
}

// SubjectPartition returns the partition count and partition of a subject
// stored through source's partition transform, ok false when subject is
// not one.
func SubjectPartition(source, subject string) (partitions, p int, ok bool) {
	_, _, partitions, p, ok = splitStored(source, subject)
	return partitions, p, ok
}

// PublishedSubject returns the subject an event was published on: a
// subject stored through source's partition transform without its two
// partition tokens, other subjects as they are. Re-publishing a stored
// event needs it, since the stream's subjects match the published form.
func PublishedSubject(source, subject string) string {
	toks, at, _, _, ok := splitStored(source, subject)
	if !ok {
		return subject
	}
	return strings.Join(append(toks[:at:at], toks[at+2:]...), ".")
}

// splitStored splits a subject stored through source's partition
// transform: its tokens, where the partition tokens are, and their values;
// ok false when subject is not one.
func splitStored(source, subject string) (toks []string, at, partitions, p int, ok bool) {
	src, at, err := slot(source)
	if err != nil {
		return nil, 0, 0, 0, false
	}
	toks = strings.Split(subject, ".")
	if len(toks) != len(src)+2 {
		return nil, 0, 0, 0, false
	}
	for i, t := range src {
		j := i
		if i >= at {
			j += 2
		}
		if t != "*" && toks[j] != t {
			return nil, 0, 0, 0, false
		}
	}
	n, err1 := strconv.Atoi(toks[at])
	q, err2 := strconv.Atoi(toks[at+1])
	if err1 != nil || err2 != nil || n < 1 || n > MaxPartitions || q < 0 || q >= n {
		return nil, 0, 0, 0, false
	}
	return toks, at, n, q, true
}

// Layout is how a stream stores the events published to it. It is read
// from the stream's own configuration (StreamLayout of its subject
// transform), never guessed from a subject's tokens: a plain stream's
// subject can have as many tokens, with numbers in the same places, as a
// partitioned one's.
type Layout struct {
	// Source is the stream subject the partition transform applies to;
	// empty when the stream stores events under their published subject.
	Source string
	// Partitions is the partition count of the transform.
	Partitions int
}

// StreamLayout returns the layout of a stream whose subject transform maps
// source to destination (both empty when it has none). A transform that
// PartitionTransform did not make leaves the layout plain.
func StreamLayout(source, destination string) Layout {
	n := TransformPartitions(source, destination)
	if n == 0 {
		return Layout{}
	}
	return Layout{Source: source, Partitions: n}
}

// Partitioned reports whether the stream partitions its subjects.
func (l Layout) Partitioned() bool { return l.Source != "" }

// Published returns the subject an event stored on subject was published
// on: what a re-publish uses and what the router's filters match.
func (l Layout) Published(subject string) string {
	if !l.Partitioned() {
		return subject
	}
	return PublishedSubject(l.Source, subject)
}

// StoredFilters returns subject filters that together match every subject
// the stream may store an event published on subject under: the subject
// itself (a plain stream, or an event stored before the transform was set)
// and, on a partitioned stream, the subject with wildcards for the
// partition tokens (any count, so events stored before a count change are
// found too). The filters do not overlap, as JetStream requires of one
// consumer's filters.
func (l Layout) StoredFilters(subject string) []string {
	if !l.Partitioned() || !SubjectMatches(subject, l.Source) {
		return []string{subject}
	}
	_, at, err := slot(l.Source)
	if err != nil {
		return []string{subject}
	}
	toks := strings.Split(subject, ".")
	out := make([]string, 0, len(toks)+2)
	out = append(out, toks[:at]...)
	out = append(out, "*", "*")
	out = append(out, toks[at:]...)
	return []string{subject, strings.Join(out, ".")}
}
