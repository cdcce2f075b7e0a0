package replication

import "testing"

func TestFormatLSNMatchesString(t *testing.T) {
	for _, lsn := range []LSN{0, 1, 0xF, 0x10, 0x16B3748, 0x16_B374D848, 0xFFFFFFFF, 0x1_00000000, 1<<64 - 1} {
		if got, want := FormatLSN(lsn), lsn.String(); got != want {
			t.Errorf("FormatLSN(%d) = %q, want %q", uint64(lsn), got, want)
		}
	}
}

func BenchmarkFormatLSN(b *testing.B) {
	b.ReportAllocs()
	for i := range b.N {
		_ = FormatLSN(LSN(0x16_B374D848 + i))
	}
}

// recordEnd backs an insert position just past a page header to the page
// boundary, where the record before it ended; any other position stays.
func TestRecordEnd(t *testing.T) {
	const blk, seg = 8192, 16 << 20
	for _, tc := range []struct{ in, want LSN }{
		{0x2000028, 0x2000000}, // after a WAL switch: a segment's long header
		{0x1928018, 0x1928000}, // a record ended on a page boundary
		{0x1928518, 0x1928518},
		{0x2000018, 0x2000018}, // a segment's first page has the long header
		{0x2002028, 0x2002028}, // not a segment's first page
		{0x1928000, 0x1928000},
	} {
		if got := recordEnd(tc.in, blk, seg); got != tc.want {
			t.Errorf("recordEnd(%s) = %s, want %s", tc.in, got, tc.want)
		}
	}
	if got := recordEnd(0x2000028, 0, 0); got != 0x2000028 {
		t.Errorf("recordEnd without sizes = %s, want the position as it is", got)
	}
}
