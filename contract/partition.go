package contract

import (
	"fmt"
	"regexp"
	"strconv"
	"strings"
)

// Partitioned subjects. A stream that serves consumer groups stores each
// event under its published subject followed by two tokens: the partition
// count P and the event's partition p = hash(wildcard tokens) mod P,
// computed by JetStream's own subject transform {{partition(P,…)}}. The
// wildcard tokens of the default template are the aggregate type and id, so
// every event of one aggregate lands in one partition. Keeping P in the
// subject lets a partition-count change start a new set of subjects while
// the old set drains (see docs/consumer.md "Changing the number of
// partitions").

// MaxPartitions bounds the partition count: each partition is one durable
// consumer per group.
const MaxPartitions = 1024

// PartitionTransform returns the destination of the stream subject
// transform that partitions the subjects matching source into partitions.
// source must hold at least one '*' token and no '>': the '*' tokens are
// what the partition is computed from.
func PartitionTransform(source string, partitions int) (string, error) {
	if partitions < 1 || partitions > MaxPartitions {
		return "", fmt.Errorf("partition count %d: want 1 to %d", partitions, MaxPartitions)
	}
	toks := strings.Split(source, ".")
	var dst []string
	var idx []string
	for _, t := range toks {
		switch t {
		case ">":
			return "", fmt.Errorf("stream subject %q ends in '>': partitioning needs the aggregate's tokens as '*' wildcards (e.g. outbox.*.*), so list the subjects without '>'", source)
		case "*":
			idx = append(idx, strconv.Itoa(len(idx)+1))
			dst = append(dst, "{{wildcard("+idx[len(idx)-1]+")}}")
		default:
			dst = append(dst, t)
		}
	}
	if len(idx) == 0 {
		return "", fmt.Errorf("stream subject %q has no '*' token to partition by: use a subject with the aggregate's type and id as wildcards (e.g. outbox.*.*)", source)
	}
	dst = append(dst, strconv.Itoa(partitions), "{{partition("+strconv.Itoa(partitions)+","+strings.Join(idx, ",")+")}}")
	return strings.Join(dst, "."), nil
}

var partitionSuffix = regexp.MustCompile(`\.(\d+)\.\{\{\s*[Pp]artition\(\s*(\d+)\s*,[\d\s,]+\)\s*\}\}$`)

// TransformPartitions returns the partition count of a subject transform
// destination made by PartitionTransform, or 0 if it is not one.
func TransformPartitions(destination string) int {
	m := partitionSuffix.FindStringSubmatch(destination)
	if m == nil || m[1] != m[2] {
		return 0
	}
	n, err := strconv.Atoi(m[1])
	if err != nil || n < 1 || n > MaxPartitions {
		return 0
	}
	return n
}

// PartitionFilter is the subject filter of partition p of partitions over
// stream subject source.
func PartitionFilter(source string, partitions, p int) string {
	return source + "." + strconv.Itoa(partitions) + "." + strconv.Itoa(p)
}

// SubjectPartition returns the partition count and partition of a stored
// partitioned subject (its last two tokens), ok false when it has none.
func SubjectPartition(subject string) (partitions, p int, ok bool) {
	toks := strings.Split(subject, ".")
	if len(toks) < 3 {
		return 0, 0, false
	}
	n, err1 := strconv.Atoi(toks[len(toks)-2])
	q, err2 := strconv.Atoi(toks[len(toks)-1])
	if err1 != nil || err2 != nil || n < 1 || q < 0 || q >= n {
		return 0, 0, false
	}
	return n, q, true
}

// PublishedSubject returns the subject an event was published on: a stored
// partitioned subject without its two partition tokens, other subjects as
// they are. Re-publishing a stored event needs it, since the stream's
// subjects match the published form.
func PublishedSubject(subject string) string {
	if _, _, ok := SubjectPartition(subject); !ok {
		return subject
	}
	toks := strings.Split(subject, ".")
	return strings.Join(toks[:len(toks)-2], ".")
}
