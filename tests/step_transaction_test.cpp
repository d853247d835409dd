// SPDX-License-Identifier: BSD-3-Clause
// The guard as one transaction: participants join it through hooks, in a
// fixed order, without the guard knowing them; each optimizer's state
// machine gets one outcome; a refusal or failure leaves nothing changed.
#include "test_util.h"

#include "session/context.h"
#include "step/guard.h"

#include <stdexcept>

namespace amp::testing {
namespace {


// Writes "<name>.<hook>" into a shared journal; can refuse or fail on cue.
class JournalParticipant final : public detail::StepParticipant {
 public:
  JournalParticipant(std::string name, std::vector<std::string>& journal) : name_(std::move(name)), journal_(journal) {}

  bool refuse = false;      // check_open throws
  bool fail_open = false;   // open throws
  bool fail_prepare = false;  // prepare throws
  bool overflow_seen = false;

  void check_open(const detail::Guard&) const override {
    if (refuse) throw std::runtime_error(name_ + " refuses");
  }
  std::unique_ptr<detail::GuardPart> open(detail::Guard&) override {
    write("open");
    if (fail_open) throw std::runtime_error(name_ + " failed to open");
    return std::make_unique<Part>(*this);
  }

 private:
  struct Part final : detail::GuardPart {
    explicit Part(JournalParticipant& owner) : owner(owner) {}
    void before_unscale(detail::Guard&) override { owner.write("before_unscale"); }
    void after_unscale(detail::Guard&) override { owner.write("after_unscale"); }
    void agree_overflow(detail::Guard&, at::Tensor&) override { owner.write("agree_overflow"); }
    void judged(detail::Guard&, detail::OverflowVerdict& verdict) override {
      owner.write("judged");
      owner.overflow_seen = verdict.snapshot[0].item<float>() > 0;
    }
    void prepare(detail::Guard&) override {
      owner.write("prepare");
      if (owner.fail_prepare) throw std::runtime_error(owner.name_ + " failed to prepare");
    }
    void commit(detail::Guard&) noexcept override { owner.write("commit"); }
    void unwind(detail::Guard&) noexcept override { owner.write("unwind"); }
    JournalParticipant& owner;
  };
  void write(const char* hook) { journal_.push_back(name_ + "." + hook); }

  std::string name_;
  std::vector<std::string>& journal_;
};

class StepTransactionTest : public AmpTest {
 protected:
  void start(Options options) {
    initialize(model_, optimizer_, quiet(options));
    detail::live_context()->join(a_);
    detail::live_context()->join(b_);
  }
  at::Tensor loss() { return model_->forward(torch::randn({4, 8})).to(at::kFloat).pow(2).mean(); }
  detail::OptimizerStep::State state() { return detail::live_context()->step_of(optimizer_)->state(); }
  // One committed guard from zeroed gradients: the first layer's gradient
  // it leaves (a copy), with the journal cleared.
  at::Tensor gradient_after_one_step() {
    optimizer_.zero_grad();
    {
      scale_loss scaled(loss(), optimizer_);
      scaled.backward();
    }
    journal_.clear();
    return model_->fc1->weight.grad().clone();
  }

  TinyNet model_;
  torch::optim::SGD optimizer_{model_->parameters(), 0.1};
  std::vector<std::string> journal_;
  JournalParticipant a_{"a", journal_}, b_{"b", journal_};
};

TEST_F(StepTransactionTest, AGuardRunsEveryHookOfEveryParticipantInOrder) {
  start(O1);
  {
    scale_loss scaled(loss(), optimizer_);
    scaled.backward();
  }
  EXPECT_THAT(journal_, ::testing::ElementsAre("a.open", "b.open", "a.before_unscale", "b.before_unscale",
                                               "a.after_unscale", "b.after_unscale", "a.agree_overflow",
                                               "b.agree_overflow", "a.judged", "b.judged", "a.prepare", "b.prepare", "a.commit",
                                               "b.commit"));
  EXPECT_FALSE(a_.overflow_seen);
  EXPECT_EQ(state(), detail::OptimizerStep::State::kReady);
}

TEST_F(StepTransactionTest, AnOverflowReachesTheParticipantsInTheVerdict) {
  start(O1);
  {
    scale_loss scaled(loss(), optimizer_);
    scaled.backward();
    model_->fc1->weight.grad()[0][0] = kInf;
  }
  EXPECT_TRUE(a_.overflow_seen);
  EXPECT_TRUE(b_.overflow_seen);
  EXPECT_EQ(skipped_steps(optimizer_), 1);
}

TEST_F(StepTransactionTest, AccumulatingAndStaticGuardsNeitherAgreeNorJudge) {
  Options options = O1;
  options.loss_scale = LossScale::Static(128.0);
  start(options);
  for (bool delay : {true, false}) {
    scale_loss scaled(loss(), optimizer_, {/*loss_id=*/0, /*delay_unscale=*/delay});
    scaled.backward();
  }
  EXPECT_THAT(journal_, ::testing::ElementsAre("a.open", "b.open", "a.before_unscale", "b.before_unscale",
                                               "a.after_unscale", "b.after_unscale", "a.prepare", "b.prepare",
                                               "a.commit", "b.commit", "a.open", "b.open", "a.before_unscale",
                                               "b.before_unscale", "a.after_unscale", "b.after_unscale",
                                               "a.prepare", "b.prepare", "a.commit", "b.commit"));
}

TEST_F(StepTransactionTest, AnExceptionUnwindsTheParticipantsInReverseAndCommitsNothing) {
  start(O1);
  const at::Tensor before = model_->fc1->weight.clone();
  try {
    scale_loss scaled(loss(), optimizer_);
    scaled.backward();
    throw std::runtime_error("the program's own error");
  } catch (const std::runtime_error&) {
  }
  EXPECT_THAT(journal_, ::testing::ElementsAre("a.open", "b.open", "b.unwind", "a.unwind"));
  EXPECT_FALSE(model_->fc1->weight.grad().defined());  // the gradients before the guard: none
  EXPECT_EQ(state(), detail::OptimizerStep::State::kReady);
  EXPECT_EQ(loss_scale(0), 65536.0);
}

TEST_F(StepTransactionTest, AParticipantThatRefusesLeavesEverythingAsItWas) {
  start(O1);
  const at::Tensor grad = gradient_after_one_step();
  b_.refuse = true;
  EXPECT_THROW({ scale_loss scaled(loss(), optimizer_); }, std::runtime_error);
  EXPECT_TRUE(journal_.empty());  // nobody opened
  EXPECT_TRUE(BitEqual(model_->fc1->weight.grad(), grad));
  EXPECT_EQ(state(), detail::OptimizerStep::State::kReady);
  b_.refuse = false;
  b_.fail_open = true;  // a participant failing to open: the parts before it unwind
  EXPECT_THROW({ scale_loss scaled(loss(), optimizer_); }, std::runtime_error);
  EXPECT_THAT(journal_, ::testing::ElementsAre("a.open", "b.open", "a.unwind"));
  EXPECT_TRUE(BitEqual(model_->fc1->weight.grad(), grad));
  EXPECT_EQ(state(), detail::OptimizerStep::State::kReady);
  b_.fail_open = false;
  journal_.clear();
  {
    scale_loss scaled(loss(), optimizer_);  // and the next guard opens normally
    scaled.backward();
  }
  EXPECT_EQ(journal_.back(), "b.commit");
}

// A participant that fails at the end: the optimizers have not committed
// either, and the whole guard unwinds - gradients, optimizer state, loss
// scale and skip counts as before it, nobody half committed.
TEST_F(StepTransactionTest, AParticipantFailingToPrepareUnwindsTheWholeStep) {
  start(O1);
  const at::Tensor grad = gradient_after_one_step();
  b_.fail_prepare = true;
  for (bool overflow : {false, true}) {
    SCOPED_TRACE(overflow ? "an overflowing step" : "a clean step");
    journal_.clear();
    EXPECT_THROW(
        {
          scale_loss scaled(loss(), optimizer_);
          scaled.backward();
          if (overflow) model_->fc1->weight.grad()[0][0] = kInf;
          scaled.finish();
        },
        std::runtime_error);
    EXPECT_THAT(journal_, ::testing::ElementsAre("a.open", "b.open", "a.before_unscale", "b.before_unscale",
                                                 "a.after_unscale", "b.after_unscale", "a.agree_overflow",
                                                 "b.agree_overflow", "a.judged", "b.judged", "a.prepare",
                                                 "b.prepare", "b.unwind", "a.unwind"));
    EXPECT_TRUE(BitEqual(model_->fc1->weight.grad(), grad));
    EXPECT_EQ(state(), detail::OptimizerStep::State::kReady);
    EXPECT_EQ(loss_scale(0), 65536.0);  // the overflow's halving undone
    EXPECT_EQ(skipped_steps(optimizer_), 0);
    EXPECT_FALSE(last_step_skipped(optimizer_));
  }
  b_.fail_prepare = false;
  journal_.clear();
  {
    scale_loss scaled(loss(), optimizer_);  // the next guard commits normally
    scaled.backward();
  }
  EXPECT_EQ(journal_.back(), "b.commit");
}

}  // namespace
}  // namespace amp::testing
