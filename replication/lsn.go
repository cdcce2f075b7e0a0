package replication

import (
	"errors"
	"strings"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
)

func parseLSN(s string) (LSN, error) { return pglogrepl.ParseLSN(s) }

// ParseLSN parses PostgreSQL's text form of an LSN, e.g. "0/16B3748".
func ParseLSN(s string) (LSN, error) { return pglogrepl.ParseLSN(s) }

// redactErr keeps passwords out of URL parse errors, which quote the input.
func redactErr(err error) error {
	var pe *pgconn.ParseConfigError
	if errors.As(err, &pe) {
		return errors.New(strings.TrimSpace("cannot parse connection string: " + pe.Unwrap().Error()))
	}
	return err
}

// FormatLSN returns PostgreSQL's text form of lsn, e.g. "16/B374D848",
// exactly as LSN.String does but without fmt: the router formats the
// commit LSN of every transaction, which at one row per transaction is a
// Sprintf per event.
func FormatLSN(lsn LSN) string {
	var b [17]byte
	return string(appendHex(appendHex(b[:0], uint32(lsn>>32)), uint32(lsn), '/'))
}

// appendHex appends v in upper-case hexadecimal without leading zeros,
// after the optional prefix bytes.
func appendHex(b []byte, v uint32, prefix ...byte) []byte {
	const digits = "0123456789ABCDEF"
	b = append(b, prefix...)
	var tmp [8]byte
	i := len(tmp)
	for {
		i--
		tmp[i] = digits[v&0xF]
		v >>= 4
		if v == 0 {
			break
		}
	}
	return append(b, tmp[i:]...)
}
