"""benchmarks/profile_fp8_ncu.py's summary of Nsight Compute's CSV pages, on small pages in ncu's layout."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import profile_fp8_ncu as prof  # noqa: E402

HEAD = '"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value","Rule Name",\n'
DETAILS = HEAD + (
    '"0","k","GPU Speed Of Light Throughput","Duration","us","120.74",\n'
    '"0","k","GPU Speed Of Light Throughput","SM Frequency","Ghz","1.61",\n'
    '"0","k","Scheduler Statistics","No Eligible","%","59.63",\n'
    '"0","k","Memory Workload Analysis","Mem Pipes Busy","%","37.27",\n'  # a section not kept
    '"0","k","","","","","HighPipeUtilization",\n'  # a rule row
)
RAW = (
    '"ID","sm__cycles_active.avg","lts__throughput.avg.pct_of_peak_sustained_elapsed","other"\n'
    '"","cycle","%",""\n'
    '"0","183564.3","50.61","7"\n'
)
SASS = (
    '"Kernel Name","k",\n'
    '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_barrier",'
    '"stall_long_sb","stall_long_sb (Not Issued)"\n'
    '"0x0","  QGMMA.64x128x32","5","100","1","4","4"\n'
    '"0x10","  WARPGROUP.DEPBAR.LE gsb0, 0x0","90","100","88","2","1"\n'
    '"0x20","  FFMA R1, R2, R3, R1","1","100","0","1","1"\n'
    '"0x30","  EXIT","4","8","0","4","4"\n'
)


def test_details_keeps_the_chosen_sections():
    out = prof.details(DETAILS)
    assert out == {
        "speed_of_light": {"Duration": "120.74 us", "SM Frequency": "1.61 Ghz"},
        "scheduler": {"No Eligible": "59.63 %"},
    }


def test_raw_metrics_pairs_values_with_units():
    out = prof.raw_metrics(
        RAW, keys=("sm__cycles_active.avg", "lts__throughput.avg.pct_of_peak_sustained_elapsed")
    )
    assert out == {
        "sm__cycles_active.avg": "183564.3 cycle",
        "lts__throughput.avg.pct_of_peak_sustained_elapsed": "50.61 %",
    }
    assert prof.raw_metrics(RAW, keys=("absent",)) == {}


def test_hot_instructions_by_share_with_their_main_stall():
    total, hot = prof.hot_instructions(SASS, share=0.04)
    assert total == 100
    assert [(h["index"], h["sass"], h["samples"], h["main_stall"]) for h in hot] == [
        (0, "QGMMA.64x128x32", 5, "stall_long_sb"),
        (1, "WARPGROUP.DEPBAR.LE gsb0, 0x0", 90, "stall_barrier"),
        (3, "EXIT", 4, "stall_long_sb"),
    ]
    assert hot[1]["share"] == 0.9 and hot[3 - 1]["executed"] == 8
    summary = prof.summarize(DETAILS, RAW, SASS, "v")
    assert summary["variant"] == "v" and summary["stall_samples"] == 100
    assert summary["speed_of_light"]["Duration"] == "120.74 us"
    assert [h["index"] for h in summary["hot_instructions"]] == [0, 1, 3]  # 1.5%: the FFMA's 1% is left out
