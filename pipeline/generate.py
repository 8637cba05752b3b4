"""Deterministic generator of a MIMIC-IV-shaped directory: the embedded default data of the main job.

Writes ``hosp/`` and ``icu/`` with the real tables' file names and headers (patients, admissions, transfers,
labevents, d_labitems, icustays, chartevents, inputevents, outputevents, procedureevents, d_items), real item ids
for the common vitals and labs, physiologically plausible values, stays that deteriorate (hypotension, hypoxia,
rising lactate, vasopressor start, invasive ventilation, death) and a few rare items. Same seed, same bytes.
"""
from __future__ import annotations

import gzip
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np

# itemid: (label, unit, normal mean, normal sd, low clip, high clip)
VITALS = {
    220045: ("Heart Rate", "bpm", 85, 12, 30, 200),
    220179: ("Non Invasive Blood Pressure systolic", "mmHg", 120, 15, 50, 230),
    220180: ("Non Invasive Blood Pressure diastolic", "mmHg", 65, 10, 25, 140),
    220052: ("Arterial Blood Pressure mean", "mmHg", 80, 9, 30, 160),
    220210: ("Respiratory Rate", "insp/min", 18, 3.5, 4, 50),
    220277: ("O2 saturation pulseoxymetry", "%", 97, 1.6, 60, 100),
    223762: ("Temperature Celsius", "°C", 37.0, 0.45, 33, 42),
}
LABS = {
    50813: ("Lactate", "mmol/L", 1.4, 0.5, 0.3, 20, "Blood Gas"),
    50912: ("Creatinine", "mg/dL", 1.0, 0.3, 0.2, 12, "Chemistry"),
    51265: ("Platelet Count", "K/uL", 230, 60, 5, 900, "Hematology"),
    50885: ("Bilirubin, Total", "mg/dL", 0.8, 0.3, 0.1, 30, "Chemistry"),
    50971: ("Potassium", "mEq/L", 4.1, 0.4, 2.0, 8.0, "Chemistry"),
    50983: ("Sodium", "mEq/L", 139, 3, 115, 165, "Chemistry"),
    51301: ("White Blood Cells", "K/uL", 9, 3, 0.5, 60, "Hematology"),
    51222: ("Hemoglobin", "g/dL", 11, 1.5, 4, 19, "Hematology"),
    50802: ("Base Excess", "mEq/L", 0, 2.5, -25, 20, "Blood Gas"),
}
# Items that few stays ever see: the rare items of the default cohort.
RARE_LABS = {
    50878: ("Asparate Aminotransferase (AST)", "IU/L", 400, 150, 10, 5000, "Chemistry"),
    50866: ("Ammonia", "umol/L", 90, 30, 5, 500, "Chemistry"),
    51003: ("Troponin T", "ng/mL", 0.6, 0.3, 0.0, 25, "Chemistry"),
}
VASOPRESSORS = {221906: ("Norepinephrine", "mg"), 221289: ("Epinephrine", "mg"), 221749: ("Phenylephrine", "mg")}
FLUIDS = {225158: ("NaCl 0.9%", "mL")}
OUTPUTS = {226559: ("Foley", "mL")}
PROCEDURES = {225792: ("Invasive Ventilation", "min"), 224385: ("Intubation", "None"),
              225802: ("Dialysis - CRRT", "min")}
CAREUNITS = ["Medical Intensive Care Unit (MICU)", "Surgical Intensive Care Unit (SICU)",
             "Cardiac Vascular Intensive Care Unit (CVICU)"]
WARDS = ["Medicine", "Emergency Department", "Med/Surg"]

HEADERS = {
    "hosp/patients": "subject_id,gender,anchor_age,anchor_year,anchor_year_group,dod",
    "hosp/admissions": "subject_id,hadm_id,admittime,dischtime,deathtime,admission_type,admit_provider_id,"
                       "admission_location,discharge_location,insurance,language,marital_status,race,edregtime,"
                       "edouttime,hospital_expire_flag",
    "hosp/transfers": "subject_id,hadm_id,transfer_id,eventtype,careunit,intime,outtime",
    "hosp/d_labitems": "itemid,label,fluid,category",
    "hosp/labevents": "labevent_id,subject_id,hadm_id,specimen_id,itemid,order_provider_id,charttime,storetime,"
                      "value,valuenum,valueuom,ref_range_lower,ref_range_upper,flag,priority,comments",
    "icu/icustays": "subject_id,hadm_id,stay_id,first_careunit,last_careunit,intime,outtime,los",
    "icu/d_items": "itemid,label,abbreviation,linksto,category,unitname,param_type,lownormalvalue,highnormalvalue",
    "icu/chartevents": "subject_id,hadm_id,stay_id,caregiver_id,charttime,storetime,itemid,value,valuenum,"
                       "valueuom,warning",
    "icu/inputevents": "subject_id,hadm_id,stay_id,caregiver_id,starttime,endtime,storetime,itemid,amount,"
                       "amountuom,rate,rateuom,orderid,linkorderid,ordercategoryname,secondaryordercategoryname,"
                       "ordercomponenttypedescription,ordercategorydescription,patientweight,totalamount,"
                       "totalamountuom,isopenbag,continueinnextdept,statusdescription,originalamount,originalrate",
    "icu/outputevents": "subject_id,hadm_id,stay_id,caregiver_id,charttime,storetime,itemid,value,valueuom",
    "icu/procedureevents": "subject_id,hadm_id,stay_id,caregiver_id,starttime,endtime,storetime,itemid,value,"
                           "valueuom,location,locationcategory,orderid,linkorderid,ordercategoryname,"
                           "ordercategorydescription,patientweight,isopenbag,continueinnextdept,statusdescription,"
                           "originalamount,originalrate",
}


@dataclass(frozen=True)
class GeneratorConfig:
    n_patients: int = 60
    seed: int = 20260
    deterioration_fraction: float = 0.45
    min_stay_hours: int = 20
    max_stay_hours: int = 96
    compress: bool = True


def _fmt(t):
    return "" if t is None else t.strftime("%Y-%m-%d %H:%M:%S")


def _num(x):
    return "" if x is None else f"{x:.4g}"


class _Tables:
    def __init__(self):
        self.rows = {k: [] for k in HEADERS}

    def add(self, table, *values):
        self.rows[table].append(",".join("" if v is None else str(v) for v in values))


@dataclass(frozen=True)
class _StayWindow:
    subject_id: int
    hadm_id: int
    stay_id: int
    intime: datetime
    outtime: datetime
    onset: datetime | None  # deterioration onset, if the stay deteriorates

    @property
    def hours(self) -> float:
        return (self.outtime - self.intime).total_seconds() / 3600.0

    def severity(self, t: datetime) -> float:
        """0 before the onset, then ramping to 1 over four hours."""
        if self.onset is None or t < self.onset:
            return 0.0
        return min(1.0, (t - self.onset).total_seconds() / 3600.0 / 4.0)


@dataclass(frozen=True)
class _StayPlan:
    """What a patient's draws decided of their ICU stay before its events are drawn."""
    subject_id: int
    hadm_id: int
    stay_id: int
    intime: datetime
    hours: int
    deteriorates: bool
    dies: bool


def _stay(tb, rng, plan: _StayPlan, ids) -> tuple:
    """One ICU stay's vitals, labs, inputs, outputs and procedures; returns (outtime, death time or None).

    The parts draw from ``rng`` in a fixed order, so the embedded data are the same bytes at every run."""
    intime, hours = plan.intime, plan.hours
    onset = intime + timedelta(hours=float(rng.uniform(0.4, 0.8) * hours)) if plan.deteriorates else None
    outtime = intime + timedelta(hours=hours)
    death = None
    if plan.dies:
        death = onset + timedelta(hours=float(rng.uniform(3, 10)))
        outtime = min(outtime, death)
    w = _StayWindow(plan.subject_id, plan.hadm_id, plan.stay_id, intime, outtime, onset)
    _vitals(tb, rng, w)
    _labs(tb, rng, w, ids)
    _fluids(tb, rng, w, ids)
    if onset is not None:
        _deterioration(tb, rng, w, ids)
    return outtime, death


_VITAL_SHIFT = {220052: -28, 220179: -40, 220277: -11, 220045: 35, 220210: 12}  # change at full severity
_LAB_SHIFT = {50813: 5.0, 50912: 1.2, 50802: -8}


def _vitals(tb, rng, w: _StayWindow) -> None:
    t = w.intime + timedelta(minutes=int(rng.integers(5, 40)))
    while t < w.outtime:
        s = w.severity(t)
        for itemid, (_, unit, mu, sd, lo, hi) in VITALS.items():
            if itemid == 220180 and rng.random() < 0.3:
                continue
            v = float(np.clip(rng.normal(mu, sd) + _VITAL_SHIFT.get(itemid, 0) * s, lo, hi))
            ct = t + timedelta(minutes=int(rng.integers(0, 5)))
            tb.add("icu/chartevents", w.subject_id, w.hadm_id, w.stay_id, int(rng.integers(1000, 9999)), _fmt(ct),
                   _fmt(ct + timedelta(minutes=7)), itemid, _num(v), _num(v), unit, 0)
        t += timedelta(minutes=int(rng.choice([30, 60, 60, 60, 120])))


def _labs(tb, rng, w: _StayWindow, ids) -> None:
    t = w.intime + timedelta(hours=float(rng.uniform(0.2, 2)))
    while t < w.outtime:
        s = w.severity(t)
        spec = int(next(ids["specimen"]))
        for itemid, (_, unit, mu, sd, lo, hi, _) in LABS.items():
            v = float(np.clip(rng.normal(mu, sd) + _LAB_SHIFT.get(itemid, 0) * s, lo, hi))
            tb.add("hosp/labevents", next(ids["labevent"]), w.subject_id, w.hadm_id, spec, itemid, "", _fmt(t),
                   _fmt(t + timedelta(minutes=50)), _num(v), _num(v), unit, "", "", "", "ROUTINE", "")
        t += timedelta(hours=float(rng.choice([4, 6, 8, 12])))
    if rng.random() < 0.12:
        itemid = int(rng.choice(list(RARE_LABS)))
        _, unit, mu, sd, lo, hi, _ = RARE_LABS[itemid]
        rt = w.intime + timedelta(hours=float(rng.uniform(0.5, max(w.hours - 0.5, 0.6))))
        v = float(np.clip(rng.normal(mu, sd), lo, hi))
        tb.add("hosp/labevents", next(ids["labevent"]), w.subject_id, w.hadm_id, int(next(ids["specimen"])),
               itemid, "", _fmt(rt), _fmt(rt + timedelta(minutes=50)), _num(v), _num(v), unit, "", "", "abnormal",
               "STAT", "")


def _fluids(tb, rng, w: _StayWindow, ids) -> None:
    """Urine output through the stay and a few fluid boluses."""
    t = w.intime + timedelta(hours=1)
    while t < w.outtime:
        v = float(max(0.0, rng.normal(80 - 50 * w.severity(t), 25)))
        tb.add("icu/outputevents", w.subject_id, w.hadm_id, w.stay_id, int(rng.integers(1000, 9999)), _fmt(t),
               _fmt(t + timedelta(minutes=3)), 226559, _num(v), "mL")
        t += timedelta(hours=float(rng.choice([1, 2, 3])))
    for _ in range(int(rng.integers(1, 4))):
        st = w.intime + timedelta(hours=float(rng.uniform(0, max(w.hours - 1, 0.5))))
        et = min(st + timedelta(hours=float(rng.uniform(0.5, 3))), w.outtime)
        _input(tb, rng, w, (st, et), (225158, float(rng.uniform(100, 1000)), "mL"), ids)


def _procedure(tb, rng, w: _StayWindow, start, end, itemid, category, ids) -> None:
    tb.add("icu/procedureevents", w.subject_id, w.hadm_id, w.stay_id, int(rng.integers(1000, 9999)), _fmt(start),
           _fmt(end), _fmt(start + timedelta(minutes=10)), itemid, _num((end - start).total_seconds() / 60.0),
           "min", "", "", next(ids["order"]), "", category, "Task", "80", 0, "", "FinishedRunning", 1, 1)


def _deterioration(tb, rng, w: _StayWindow, ids) -> None:
    """Vasopressor start within 1-3 h of onset, ventilation in some, CRRT rarely."""
    vt = w.onset + timedelta(hours=float(rng.uniform(1, 3)))
    if vt < w.outtime:
        itemid = int(rng.choice(list(VASOPRESSORS), p=[0.7, 0.15, 0.15]))
        _input(tb, rng, w, (vt, w.outtime), (itemid, float(rng.uniform(0.5, 8)), "mg"), ids)
    if rng.random() < 0.6:
        it = w.onset + timedelta(hours=float(rng.uniform(0.5, 4)))
        if it < w.outtime:
            for itemid in (224385, 225792):
                _procedure(tb, rng, w, it, w.outtime if itemid == 225792 else it + timedelta(minutes=1), itemid,
                           "Ventilation", ids)
    if rng.random() < 0.1:
        ct = w.onset + timedelta(hours=2)
        if ct < w.outtime:
            _procedure(tb, rng, w, ct, w.outtime, 225802, "Dialysis", ids)


def _input(tb, rng, w: _StayWindow, span: tuple, dose: tuple, ids) -> None:
    """An infusion of ``dose`` (itemid, amount, unit) over ``span`` (start, end)."""
    (st, et), (itemid, amount, unit) = span, dose
    hours = max((et - st).total_seconds() / 3600.0, 1e-3)
    tb.add("icu/inputevents", w.subject_id, w.hadm_id, w.stay_id, int(rng.integers(1000, 9999)), _fmt(st), _fmt(et),
           _fmt(st + timedelta(minutes=5)), itemid, _num(amount), unit, _num(amount / hours), f"{unit}/hour",
           next(ids["order"]), "", "01-Drips", "", "Main order parameter", "Continuous Med", "80", _num(amount),
           unit, 0, 0, "FinishedRunning", _num(amount), _num(amount / hours))


def generate(out_dir: Path, config: GeneratorConfig = GeneratorConfig()) -> Path:
    """Write the MIMIC-IV-shaped directory into ``out_dir``; returns its path."""
    out = Path(out_dir)
    rng = np.random.default_rng(config.seed)
    tb = _Tables()
    counters = {k: iter(range(start, 10**12)) for k, start in
                (("labevent", 1), ("specimen", 10_000_000), ("order", 100_000), ("transfer", 30_000_000))}
    for i in range(config.n_patients):
        _patient(tb, rng, config, i, counters)
    _dictionaries(tb)
    _write_tables(tb, out, config.compress)
    return out


def _patient(tb, rng, config: GeneratorConfig, i: int, counters: dict) -> None:
    """Patient ``i``: their admission, one ICU stay and its events, transfers (draws in a fixed order)."""
    subject_id = 10_000_000 + 37 * i + 1
    hadm_id = 20_000_000 + 53 * i + 3
    stay_id = 30_000_000 + 71 * i + 5
    age = int(rng.integers(16, 91))  # a few minors: the cohort keeps adults only
    anchor_year = int(rng.integers(2110, 2190))
    admit = datetime(anchor_year, 1, 1) + timedelta(days=int(rng.integers(0, 360)),
                                                    minutes=int(rng.integers(0, 1440)))
    deteriorates = rng.random() < config.deterioration_fraction
    dies = deteriorates and rng.random() < 0.3
    hours = int(rng.integers(config.min_stay_hours, config.max_stay_hours + 1))
    if rng.random() < 0.08:
        hours = int(rng.integers(3, 10))  # short stays: excluded by the cohort's minimum length
    ward_hours = float(rng.uniform(2, 30))
    intime = admit + timedelta(hours=ward_hours)
    outtime, death = _stay(tb, rng, _StayPlan(subject_id, hadm_id, stay_id, intime, hours, deteriorates, dies),
                           counters)
    disch = death if death else outtime + timedelta(hours=float(rng.uniform(12, 96)))
    unit = CAREUNITS[int(rng.integers(len(CAREUNITS)))]
    ward = WARDS[int(rng.integers(len(WARDS)))]
    tb.add("hosp/patients", subject_id, "MF"[int(rng.integers(2))], age, anchor_year,
           f"{anchor_year - anchor_year % 3} - {anchor_year - anchor_year % 3 + 2}",
           death.strftime("%Y-%m-%d") if death else "")
    tb.add("hosp/admissions", subject_id, hadm_id, _fmt(admit), _fmt(disch), _fmt(death), "EW EMER.", "P00001",
           "EMERGENCY ROOM", "DIED" if death else "HOME", "Medicare", "ENGLISH", "SINGLE", "WHITE",
           _fmt(admit), _fmt(admit + timedelta(hours=2)), int(death is not None))
    transfers = [("admit", ward, admit, intime), ("transfer", unit, intime, outtime)]
    if death is None:
        transfers.append(("transfer", ward, outtime, disch))
    for kind, where, start, end in transfers:
        tb.add("hosp/transfers", subject_id, hadm_id, next(counters["transfer"]), kind, where, _fmt(start),
               _fmt(end))
    tb.add("hosp/transfers", subject_id, hadm_id, next(counters["transfer"]), "discharge", "", _fmt(disch), "")
    los = (outtime - intime).total_seconds() / 86400.0
    tb.add("icu/icustays", subject_id, hadm_id, stay_id, unit, unit, _fmt(intime), _fmt(outtime), f"{los:.6f}")


def _dictionaries(tb) -> None:
    for itemid, (label, _, _, _, _, _, cat) in {**LABS, **RARE_LABS}.items():
        tb.add("hosp/d_labitems", itemid, f'"{label}"', "Blood", cat)
    for itemid, (label, unit, *_rest) in VITALS.items():
        tb.add("icu/d_items", itemid, f'"{label}"', "", "chartevents", "Routine Vital Signs", unit, "Numeric", "", "")
    for group, linksto, cat in ((VASOPRESSORS, "inputevents", "Medications"), (FLUIDS, "inputevents", "Fluids"),
                                (OUTPUTS, "outputevents", "Output"), (PROCEDURES, "procedureevents", "Procedures")):
        for itemid, (label, unit) in group.items():
            tb.add("icu/d_items", itemid, f'"{label}"', "", linksto, cat, unit, "Solution", "", "")


def _write_tables(tb, out: Path, compress: bool) -> None:
    for table, header in HEADERS.items():
        path = out / f"{table}.csv{'.gz' if compress else ''}"
        path.parent.mkdir(parents=True, exist_ok=True)
        text = "\n".join([header, *tb.rows[table]]) + "\n"
        if compress:
            # mtime=0: identical bytes on every run
            with open(path, "wb") as fh, gzip.GzipFile(fileobj=fh, mode="wb", mtime=0) as gz:
                gz.write(text.encode())
        else:
            path.write_text(text)
