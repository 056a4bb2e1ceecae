//! JUnit XML: one test suite per mode, one test case per layer; a failure carries the verdict.

use super::Report;
use quick_junit::{NonSuccessKind, Report as JReport, TestCase, TestCaseStatus, TestSuite};

pub fn render(r: &Report) -> String {
    let mut report = JReport::new("mla-diff");
    for m in &r.modes {
        let mut suite = TestSuite::new(format!("{} {} {}", r.file.path, m.mode, r.run.dtype));
        for n in &r.run.notices {
            suite.add_property(quick_junit::Property::new("mla-diff.notice", n.as_str()));
        }
        for l in &m.layers {
            let status = if l.pass {
                TestCaseStatus::success()
            } else {
                let c = l
                    .checks
                    .iter()
                    .find(|c| !c.pass)
                    .expect("failing layer has a failing check");
                let mut s = TestCaseStatus::non_success(NonSuccessKind::Failure);
                s.set_message(format!("layer {} diverges at {}", l.layer, c.check));
                s.set_description(c.reasons.join("\n"));
                s
            };
            let mut tc = TestCase::new(format!("layer {}", l.layer), status);
            tc.set_classname(format!("mla-diff.{}", m.mode));
            suite.add_test_case(tc);
        }
        report.add_test_suite(suite);
    }
    report.to_string().expect("junit serialises")
}
