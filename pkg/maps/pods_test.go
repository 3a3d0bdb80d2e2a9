package maps

import (
	"testing"

	"github.com/redirector-mesh/redirector/bpf"
)

// TestPodSettingsFlags: every setting goes to its own flag bit of
// enum pod_flag and comes back from it, alone and with the others.
func TestPodSettingsFlags(t *testing.T) {
	for _, tc := range []struct {
		s    PodSettings
		want uint32
	}{
		{PodSettings{PodID: 7}, 0},
		{PodSettings{CaptureOutbound: true, PodID: 7}, uint32(bpf.CapturePodFlagPOD_CAPTURE_OUTBOUND)},
		{PodSettings{CaptureInbound: true, PodID: 7}, uint32(bpf.CapturePodFlagPOD_CAPTURE_INBOUND)},
		{PodSettings{CaptureDNS: true, PodID: 7}, uint32(bpf.CapturePodFlagPOD_CAPTURE_DNS)},
		{PodSettings{CaptureOutbound: true, CaptureInbound: true, CaptureDNS: true, PodID: 7}, 7},
	} {
		r := tc.s.raw()
		if r.Flags != tc.want || r.PodId != 7 {
			t.Errorf("%+v: raw flags %#x pod id %d, want flags %#x pod id 7", tc.s, r.Flags, r.PodId, tc.want)
		}
		if back := settingsOf(r); back != tc.s {
			t.Errorf("%+v: read back as %+v", tc.s, back)
		}
	}
	if bpf.CapturePodFlagPOD_CAPTURE_DNS != 1<<2 {
		t.Errorf("POD_CAPTURE_DNS is %#x, want 1<<2", bpf.CapturePodFlagPOD_CAPTURE_DNS)
	}
}
